"""Routing profiles: which policy routes, with every parameter it takes, as typed data.

A profile is one frozen msgspec struct per policy, tagged by the policy's name in the field
`policy` (`RoutingProfile` is their union): `EldrProfile(tau=0.2)` encodes as
`{"policy": "eldr", "load_measure": "requests", "tau": 0.2, "widen_to": 2}`. Each parameter's
default is written here and nowhere else; its constraints are `msgspec.Meta` annotations,
checked whenever a profile is decoded or converted (settings, the wire, `validated`), and
unknown fields are refused. Everything that routes or reasons about routing carries a
profile: the router's settings and its run-time switch (`RouterControl`), each decision's
record (`Decision.profile`), the trainer's shadow gate, replay, explain, the benchmark, the
demo. The policy that acts on a profile is built by `eldr.core.routing.policies.make_policy`.

The shape follows the plug-in routers (llm-d's filter -> scorer -> picker configured as
data): the policy is code, its configuration is a typed value that can be logged, recorded,
compared and replayed.

`profile_from_params` is the one place where loose names and values become a profile: the
legacy settings (`ELDR_POLICY`, `ELDR_TAU`, `ELDR_LOAD_MEASURE`), the legacy fields of
`RouterControl`, the untyped `params` of decisions recorded before `Decision` v3, and
command-line switches (`--policy`, `--tau`, `--param`).

Pure: msgspec and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal, TypeAlias, TypeVar, cast, get_args

import msgspec
from msgspec import Meta

__all__ = [
    "DEFAULT_PROFILE",
    "LOAD_MEASURES",
    "LOAD_ONLY_PROFILES",
    "PAPER_PROFILE",
    "PRIOR_TOKENS",
    "PROFILE_TYPES",
    "ROUTER_POLICIES",
    "EldrBoundedProfile",
    "EldrCostProfile",
    "EldrProfile",
    "JsqProfile",
    "LoadMeasure",
    "OracleProfile",
    "P2cProfile",
    "ProfileBase",
    "RandomProfile",
    "RoundRobinProfile",
    "RoutingProfile",
    "as_routing_profile",
    "decode_profile",
    "encode_profile",
    "params_taken",
    "profile_from_params",
    "profile_type",
    "validated",
]

LoadMeasure = Literal["requests", "kv_tokens"]
"""What a policy balances: in-flight requests (running + waiting + assigned but not yet
admitted) or KV tokens (held or about to be held in the worker's KV cache)."""
LOAD_MEASURES: tuple[LoadMeasure, ...] = get_args(LoadMeasure)

PRIOR_TOKENS = 1.0
"""Pseudo-tokens a request's predicted expert demand is smoothed with towards uniform
(`eldr.core.routing.activity.expert_demand`): the cost-aware policy's `prior_tokens`
default, and what every other policy predicts with (the router still tracks activity)."""

# Bounds keep decoded values finite and meaningful (cosine scores lie in [-1, 1], so a band
# wider than 2 holds every worker; the others are far beyond any useful setting).
Tau = Annotated[float, Meta(ge=0.0, le=2.0)]
WidenTo = Annotated[int, Meta(ge=1, le=4096)]
Slack = Annotated[float, Meta(ge=0.0, le=1e6)]
LocalityWeight = Annotated[float, Meta(ge=0.0, le=1e9)]
PriorTokens = Annotated[float, Meta(gt=0.0, le=1e9)]
TopK = Annotated[int, Meta(ge=0, le=4096)]


class ProfileBase(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="policy"
):
    """What every profile answers; subclasses add their parameters and a tag (the policy's
    name). Hashable and compared by value, so a profile can key a cache."""

    uses_signature: ClassVar[bool] = False
    """Routes by partition scores (the band rules); load-only, and says why, without them."""
    uses_activity: ClassVar[bool] = False
    """Reads the request's predicted expert demand and each worker's activity."""
    draws: ClassVar[bool] = False
    """Its choice is a random draw even without ties (random; P2C's pair)."""
    stateful: ClassVar[bool] = False
    """Its choice depends on its own previous ones (the round-robin cursor), so a replay
    runs it from the same router replica's previous decision."""
    scores_decode: ClassVar[bool] = False
    """The benchmark scores it with the request's decode signature (the oracle row)."""

    @property
    def name(self) -> str:
        """The policy's name (the profile's tag)."""
        return str(self.__struct_config__.tag)

    @property
    def wants_scores(self) -> bool:
        """Whether the caller should compute partition scores for it."""
        return self.uses_signature

    @property
    def needs_signature(self) -> bool:
        """Whether routing reads the request's prefill counts (fetch them for it)."""
        return self.uses_signature or self.uses_activity or self.wants_scores

    @property
    def measure(self) -> LoadMeasure:
        """The load it balances, and the load its decisions record and fall back on."""
        return "requests"

    @property
    def band_tau(self) -> float | None:
        """The band width an approximate centroid index must keep exact (None: no band)."""
        return None

    @property
    def demand_model(self) -> tuple[int, float]:
        """(top_k, prior_tokens) of the request's predicted expert demand; top_k 0:
        estimated per request from its counts and prompt length."""
        return 0, PRIOR_TOKENS

    def params(self) -> dict[str, float | int | str]:
        """Its parameters by name (reports, metrics and `RouterControlReply.params`)."""
        return msgspec.structs.asdict(self)

    def describe(self) -> str:
        """One line, e.g. "eldr (load_measure requests, tau 0.1, widen_to 2)"."""
        parts = [
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.params().items()
        ]
        return f"{self.name} ({', '.join(parts)})" if parts else self.name


class RoundRobinProfile(ProfileBase, frozen=True, tag="round_robin"):
    """Each live worker in turn (by worker id, so joins and departures keep the cycle)."""

    stateful: ClassVar[bool] = True


class RandomProfile(ProfileBase, frozen=True, tag="random"):
    """A live worker drawn uniformly."""

    draws: ClassVar[bool] = True


class _Balancing(ProfileBase, frozen=True):
    """A profile whose policy balances a load measure (every one but round-robin and
    random)."""

    load_measure: LoadMeasure = "requests"

    @property
    def measure(self) -> LoadMeasure:
        return self.load_measure


class JsqProfile(_Balancing, frozen=True, tag="jsq"):
    """Join the shortest queue: the least loaded live worker, ties at random."""


class P2cProfile(_Balancing, frozen=True, tag="p2c"):
    """Power of two choices: two live workers drawn, the less loaded taken."""

    draws: ClassVar[bool] = True


class EldrProfile(_Balancing, frozen=True, tag="eldr"):
    """The ELDR paper's band rule: the least loaded worker among those whose centroid
    scores within `tau` of the best; a band of one widens to the `widen_to` best."""

    uses_signature: ClassVar[bool] = True
    tau: Tau = 0.1
    """Band width, cosine units (the paper's default; it sweeps 0 to 0.3)."""
    widen_to: WidenTo = 2
    """Workers a single-member band widens to when tau > 0 (1: never widen)."""

    @property
    def band_tau(self) -> float | None:
        return self.tau


class EldrBoundedProfile(EldrProfile, frozen=True, tag="eldr_bounded"):
    """The band rule over the workers whose load is at most (1 + slack) x the mean + 1."""

    slack: Slack = 0.1


class OracleProfile(EldrProfile, frozen=True, tag="oracle"):
    """The band rule fed each request's true decode signature (benchmark only)."""

    scores_decode: ClassVar[bool] = True


class EldrCostProfile(_Balancing, frozen=True, tag="eldr_cost"):
    """Cost-model-aware: the worker where the request adds the least predicted step cost
    (docs/ONLINE.md); no partition needed."""

    uses_activity: ClassVar[bool] = True
    locality_weight: LocalityWeight = 0.0
    """Bonus per unit of partition score, in expert loads per step (0: no partition)."""
    prior_tokens: PriorTokens = PRIOR_TOKENS
    """Pseudo-tokens the demand prediction is smoothed with (`PRIOR_TOKENS`)."""
    top_k: TopK = 0
    """Experts per token per layer for the demand prediction; 0: estimated per request."""

    @property
    def wants_scores(self) -> bool:
        return self.locality_weight > 0

    @property
    def demand_model(self) -> tuple[int, float]:
        return self.top_k, self.prior_tokens


RoutingProfile: TypeAlias = (
    RoundRobinProfile
    | RandomProfile
    | JsqProfile
    | P2cProfile
    | EldrProfile
    | EldrBoundedProfile
    | EldrCostProfile
    | OracleProfile
)
"""Every policy's profile; decoded by its `policy` tag."""

PROFILE_TYPES: dict[str, type[RoutingProfile]] = {
    str(t.__struct_config__.tag): t for t in get_args(RoutingProfile)
}
"""Profile type by policy name, in the union's order."""
_MEMBERS = frozenset(PROFILE_TYPES.values())
ROUTER_POLICIES: tuple[str, ...] = tuple(n for n, t in PROFILE_TYPES.items() if not t.scores_decode)
"""The policies a router runs: every one but the benchmark's oracle."""

DEFAULT_PROFILE: RoutingProfile = EldrCostProfile()
"""What routers, the trainer's shadow gate and `eldr bench` use unless told otherwise."""
PAPER_PROFILE: RoutingProfile = EldrProfile()
"""The ELDR paper's band rule, always selectable and reported beside the default."""
LOAD_ONLY_PROFILES: tuple[RoutingProfile, ...] = (
    RoundRobinProfile(),
    RandomProfile(),
    JsqProfile(),
    P2cProfile(),
)
"""The four baselines (round-robin, random, JSQ, P2C)."""


def profile_type(name: str) -> type[RoutingProfile]:
    """The profile type of policy `name`; ValueError naming the known ones."""
    try:
        return PROFILE_TYPES[name]
    except KeyError:
        known = ", ".join(PROFILE_TYPES)
        raise ValueError(f"unknown policy {name!r} (known: {known})") from None


P = TypeVar("P", bound="ProfileBase")


def as_routing_profile(profile: ProfileBase) -> RoutingProfile:
    """`profile` as a member of `RoutingProfile` (what the wire carries); TypeError for a
    profile outside it (a benchmark's own)."""
    if type(profile) not in _MEMBERS:
        raise TypeError(f"{type(profile).__name__} is not a RoutingProfile")
    return cast(RoutingProfile, profile)


def validated(profile: P) -> P:
    """`profile` with its constraints checked (a struct built in code is not: msgspec
    checks them on decode and convert only); ValueError says which field is wrong."""
    try:
        return msgspec.convert(msgspec.to_builtins(profile), type(profile))
    except msgspec.ValidationError as exc:
        raise ValueError(f"policy {profile.name!r}: {exc}") from None


def encode_profile(profile: ProfileBase) -> str:
    """A profile's JSON, every parameter written out (what `ELDR_ROUTING_PROFILE` takes)."""
    return msgspec.json.encode(profile).decode()


def decode_profile(data: str | bytes) -> RoutingProfile:
    """A profile from its JSON (e.g. `{"policy": "eldr", "tau": 0.2}`); ValueError with
    msgspec's reason (unknown policy or field, a value out of range)."""
    try:
        return msgspec.json.decode(data, type=RoutingProfile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"routing profile {data!r}: {exc}") from None


def params_taken(policy: str, params: Mapping[str, object]) -> dict[str, object]:
    """The entries of `params` that policy `policy` takes: one setting meant for several
    policies at once (a benchmark's `--tau` over its lineup, a replay's what-if) applies
    to those that take it."""
    takes = profile_type(policy).__struct_fields__
    return {k: v for k, v in params.items() if k in takes}


def profile_from_params(
    policy: str,
    params: Mapping[str, object] | None = None,
    *,
    keep: ProfileBase | None = None,
) -> RoutingProfile:
    """The profile of `policy` with `params` set: the one mapping of loose names and
    values onto a profile.

    keep: a profile whose parameters carry over where `policy` takes them and `params`
    does not set them (switching policy keeps, say, the load measure and the band width).
    A parameter `policy` does not take is an error (ValueError naming what it takes), as
    is a value the profile's constraints refuse.
    """
    kind = profile_type(policy)
    takes = tuple(msgspec.structs.fields(kind))
    names = {f.name for f in takes}
    given = dict(params or {})
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(
            f"policy {policy!r} takes no parameter {', '.join(unknown)} "
            f"(it takes: {', '.join(sorted(names)) or 'none'})"
        )
    values: dict[str, object] = {}
    if keep is not None:
        values = {k: v for k, v in keep.params().items() if k in names}
    values.update(given)
    try:
        # Lax: command-line values come as floats or strings ("--param widen_to=3").
        return msgspec.convert(values, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"policy {policy!r}: {exc}") from None
