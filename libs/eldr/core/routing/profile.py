"""Routing profiles: which policy routes, with every parameter it takes, as typed data.

A profile is one frozen msgspec struct per policy, tagged by the policy's name in the field
`policy` (`RoutingProfile` is their union): `EldrProfile(tau=0.2)` encodes as
`{"policy": "eldr", "load_measure": "requests", "tau": 0.2, "widen_to": 2}`. Each parameter's
default is written here and nowhere else; its constraints are `msgspec.Meta` annotations,
checked whenever a profile is decoded or converted (settings, the wire, `validated`), and
unknown fields are refused. Everything that routes or reasons about routing carries a
profile: the router's settings and its run-time switch (`RouterControl`), each decision's
record (`Decision.profile`), the trainer's shadow gate, replay, explain, the benchmark, the
demo. The policy that acts on a profile is built by `eldr.core.routing.pipeline.make_policy`.

The shape follows the plug-in routers (llm-d's filter -> scorer -> picker configured as
data): a profile names the stages of one routing pipeline (`Pipeline`: candidates, filters,
weighted scorers, a picker; each stage a typed struct here, its function in
`eldr.core.routing.stages`), so a policy is a value that can be logged, recorded, compared
and replayed; `PipelineProfile` lists stages directly, a new policy without new code.

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
    "COST_TOLERANCE",
    "DEFAULT_PROFILE",
    "LOAD_MEASURES",
    "LOAD_ONLY_PROFILES",
    "MAX_STAGES",
    "NEAREST_K",
    "PAPER_PROFILE",
    "PRIOR_TOKENS",
    "PROFILE_TYPES",
    "ROUTER_POLICIES",
    "AllLive",
    "Band",
    "CandidateStage",
    "CentroidCost",
    "Cheapest",
    "Cycle",
    "Drawn",
    "EldrBandCostProfile",
    "EldrBoundedProfile",
    "EldrCostProfile",
    "EldrProfile",
    "FilterStage",
    "FixedAssignmentProfile",
    "JsqProfile",
    "LoadCeiling",
    "LoadCost",
    "LoadMeasure",
    "MarginalUnionCost",
    "NearestCentroids",
    "OracleProfile",
    "P2cProfile",
    "PickerStage",
    "Pipeline",
    "PipelineProfile",
    "ProfileBase",
    "RandomProfile",
    "RoundRobinProfile",
    "RoutingProfile",
    "ScorerStage",
    "Stage",
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


# --- stages -----------------------------------------------------------------------------------
#
# A routing decision is a pipeline of small pure functions (`eldr.core.routing.stages`, run by
# `eldr.core.routing.pipeline`): candidate generation, filters, weighted scorers and a picker.
# These structs name them and carry their parameters; a profile lists them (`ProfileBase.
# pipeline`). Scorers return costs in their own units (requests, KV tokens, expert loads per
# step, cosine), lower is better, and the picker takes the least weighted sum: a weight then
# says how many units of one term are worth one unit of another (e.g. expert loads per unit of
# cosine), which a sum of scores clamped to [0, 1] (llm-d's scorers) cannot say.


class Stage(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="stage"
):
    """One stage of a routing pipeline, tagged by its name."""

    requires_scores: ClassVar[bool] = False
    """Cannot run without the request's partition scores: the decision then falls back to
    the least loaded live worker and says why."""
    reads_scores: ClassVar[bool] = False
    """Reads the request's partition scores when there are some."""
    reads_activity: ClassVar[bool] = False
    """Reads the request's predicted expert demand and the candidates' activity."""
    draws: ClassVar[bool] = False
    """Its result is a random draw even without ties."""
    stateful: ClassVar[bool] = False
    """Its result depends on the pipeline's previous decisions (the round-robin cursor)."""

    @property
    def name(self) -> str:
        return str(self.__struct_config__.tag)

    def describe(self) -> str:
        """e.g. "band(tau 0.1, widen_to 2)"."""
        parts = [
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in msgspec.structs.asdict(self).items()
        ]
        return f"{self.name}({', '.join(parts)})" if parts else self.name


# Candidates: which live workers a decision looks at.


class AllLive(Stage, frozen=True, tag="all_live"):
    """Every live worker (what the four baselines and the older rules look at)."""


NearestK = Annotated[int, Meta(ge=1, le=4096)]


NEAREST_K = 16
"""Centroids the default retrieves per decision: every worker of the paper's main setup
(16 decoders), and what bounds the work of a decision in a larger fleet."""


class NearestCentroids(Stage, frozen=True, tag="nearest"):
    """The live owners of the `k` centroids nearest the request's signature, found through
    the partition's centroid index (hnswlib from a few hundred centroids on, an exact product
    below), plus the live workers the partition has no centroid for (they joined since the
    fit). Only these workers' loads, scores and activity are read, so a decision's work does
    not grow with the fleet; a band filter after it holds at most `k` scored members."""

    requires_scores: ClassVar[bool] = True
    reads_scores: ClassVar[bool] = True
    k: NearestK = NEAREST_K


DrawCount = Annotated[int, Meta(ge=1, le=2)]


class Drawn(Stage, frozen=True, tag="drawn"):
    """`n` live workers drawn uniformly without replacement (random: 1, P2C: 2); one
    drawn worker is the decision."""

    draws: ClassVar[bool] = True
    n: DrawCount = 1


class Cycle(Stage, frozen=True, tag="cycle"):
    """The next live worker after the previous decision's, by worker id (round-robin; joins
    and departures keep the cycle); it is the decision."""

    stateful: ClassVar[bool] = True


CandidateStage: TypeAlias = AllLive | NearestCentroids | Drawn | Cycle

# Filters: which candidates stay.


class LoadCeiling(Stage, frozen=True, tag="load_ceiling"):
    """The candidates whose load (the profile's measure) is at most (1 + slack) x the live
    fleet's mean + 1 (the +1 lets an idle fleet take a first request anywhere), so locality
    never piles a worker beyond that. Skipped when it would leave no candidate with a
    partition score (nothing to be local to)."""

    reads_scores: ClassVar[bool] = True
    slack: Slack = 0.1


class Band(Stage, frozen=True, tag="band"):
    """The ELDR paper's locality band: the candidates whose centroid scores within `tau` of
    the best candidate's; a band of one widens to the `widen_to` best when tau > 0; live
    workers without a centroid join while they are less loaded than every member (a worker
    that joined since the fit gets traffic before the next refit)."""

    requires_scores: ClassVar[bool] = True
    reads_scores: ClassVar[bool] = True
    tau: Tau = 0.1
    """Band width, cosine units (the paper's default; it sweeps 0 to 0.3)."""
    widen_to: WidenTo = 2
    """Workers a single-member band widens to when tau > 0 (1: never widen)."""


FilterStage: TypeAlias = LoadCeiling | Band

# Scorers: what each remaining candidate costs.

Weight = Annotated[float, Meta(ge=0.0, le=1e9)]


class LoadCost(Stage, frozen=True, tag="load"):
    """The candidate's load (the profile's measure: in-flight requests or KV tokens)."""

    weight: Weight = 1.0


class MarginalUnionCost(Stage, frozen=True, tag="marginal_union"):
    """What sending the request there adds to the fleet's decode cost, in expert loads per
    step: U + (n + 1) dU, with U the candidate's predicted expert union per step, dU what
    the request adds to it and n its requests in flight (its own steps cost U + dU, and
    each of the n others is slowed by dU; docs/ONLINE.md). From the router's activity
    table; without one every candidate has U = 0 and dU = the request's expected experts."""

    reads_activity: ClassVar[bool] = True
    weight: Weight = 1.0


class CentroidCost(Stage, frozen=True, tag="centroid"):
    """Minus the candidate's partition score (cosine), 0 without a centroid: with weight w,
    a unit of cosine is worth w of the other terms' units."""

    reads_scores: ClassVar[bool] = True
    weight: Weight = 1.0


ScorerStage: TypeAlias = LoadCost | MarginalUnionCost | CentroidCost

Tolerance = Annotated[float, Meta(ge=0.0, le=1e-3)]


class Cheapest(Stage, frozen=True, tag="cheapest"):
    """The candidate of least weighted cost; candidates within `tolerance` (relative, of
    max(1, |least|)) of it are tied and one is drawn with the decision's seeded generator,
    so a replay re-creates the draw."""

    tolerance: Tolerance = 0.0


PickerStage: TypeAlias = Cheapest

MAX_STAGES = 8
"""Filters, and scorers, a pipeline given as data may list (a profile is recorded with
every decision: its size stays small)."""


class Pipeline(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Candidates -> filters -> weighted scorers -> picker: what a profile routes with."""

    candidates: CandidateStage = AllLive()
    filters: tuple[FilterStage, ...] = ()
    scorers: tuple[ScorerStage, ...] = (LoadCost(),)
    picker: PickerStage = Cheapest()

    @property
    def stages(self) -> tuple[Stage, ...]:
        return (self.candidates, *self.filters, *self.scorers, self.picker)

    def describe(self) -> str:
        """e.g. "all_live | band(tau 0.1, widen_to 2) | load(weight 1) | cheapest(...)"."""
        return " | ".join(s.describe() for s in self.stages)


# --- profiles ---------------------------------------------------------------------------------


class ProfileBase(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="policy"
):
    """What every profile answers; subclasses add their parameters, a tag (the policy's
    name) and the pipeline those parameters make (`pipeline`). Hashable and compared by
    value, so a profile can key a cache. What a policy reads and whether it draws are its
    pipeline's stages' to say."""

    scores_decode: ClassVar[bool] = False
    """The benchmark scores it with the request's decode signature (the oracle row)."""

    @property
    def name(self) -> str:
        """The policy's name (the profile's tag)."""
        return str(self.__struct_config__.tag)

    @property
    def pipeline(self) -> Pipeline:
        """The stages this profile routes with (JSQ's by default)."""
        return Pipeline()

    @property
    def uses_signature(self) -> bool:
        """Routes by partition scores (a band, or centroid candidates); load-only, and says
        why, without them."""
        return any(s.requires_scores for s in self.pipeline.stages)

    @property
    def uses_activity(self) -> bool:
        """Reads the request's predicted expert demand and the workers' activity."""
        return any(s.reads_activity for s in self.pipeline.stages)

    @property
    def draws(self) -> bool:
        """Its choice is a random draw even without ties (random; P2C's pair)."""
        return any(s.draws for s in self.pipeline.stages)

    @property
    def stateful(self) -> bool:
        """Its choice depends on its own previous ones (the round-robin cursor), so a
        replay runs it from the same router replica's previous decision."""
        return any(s.stateful for s in self.pipeline.stages)

    @property
    def wants_scores(self) -> bool:
        """Whether the caller should compute partition scores for it."""
        return any(s.reads_scores or s.requires_scores for s in self.pipeline.stages)

    @property
    def needs_signature(self) -> bool:
        """Whether routing reads the request's prefill counts (fetch them for it)."""
        return self.uses_signature or self.uses_activity or self.wants_scores

    @property
    def fleet_scale(self) -> bool:
        """Whether its decisions read only their candidates (centroid candidates), not
        every live worker: their records then list the candidates, not the fleet."""
        return isinstance(self.pipeline.candidates, NearestCentroids)

    @property
    def measure(self) -> LoadMeasure:
        """The load it balances, and the load its decisions record and fall back on."""
        return "requests"

    @property
    def band_tau(self) -> float | None:
        """The band width an approximate centroid index must keep exact (None: no band)."""
        for f in self.pipeline.filters:
            if isinstance(f, Band):
                return f.tau
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

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(candidates=Cycle())


class RandomProfile(ProfileBase, frozen=True, tag="random"):
    """A live worker drawn uniformly."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(candidates=Drawn(n=1))


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

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(candidates=Drawn(n=2))


class EldrProfile(_Balancing, frozen=True, tag="eldr"):
    """The ELDR paper's band rule: the least loaded worker among those whose centroid
    scores within `tau` of the best; a band of one widens to the `widen_to` best."""

    tau: Tau = 0.1
    """Band width, cosine units (the paper's default; it sweeps 0 to 0.3)."""
    widen_to: WidenTo = 2
    """Workers a single-member band widens to when tau > 0 (1: never widen)."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(filters=(Band(tau=self.tau, widen_to=self.widen_to),))


class EldrBoundedProfile(EldrProfile, frozen=True, tag="eldr_bounded"):
    """The band rule over the workers whose load is at most (1 + slack) x the mean + 1."""

    slack: Slack = 0.1

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(
            filters=(LoadCeiling(slack=self.slack), Band(tau=self.tau, widen_to=self.widen_to))
        )


class OracleProfile(EldrProfile, frozen=True, tag="oracle"):
    """The band rule fed each request's true decode signature (benchmark only)."""

    scores_decode: ClassVar[bool] = True


COST_TOLERANCE = 1e-9
"""Relative tolerance within which the cost-aware rules' costs tie (sums of floats)."""


class _CostAware(_Balancing, frozen=True):
    """A profile whose pipeline scores by the request's predicted expert demand; its
    subclasses declare `prior_tokens` and `top_k` (after their own fields: the order is
    the order records encode them in)."""

    @property
    def demand_model(self) -> tuple[int, float]:
        top_k: int = getattr(self, "top_k")  # noqa: B009 (declared by each subclass, last)
        prior_tokens: float = getattr(self, "prior_tokens")  # noqa: B009
        return top_k, prior_tokens


class EldrCostProfile(_CostAware, frozen=True, tag="eldr_cost"):
    """Cost-model-aware over every live worker: the one where the request adds the least
    predicted step cost (docs/ONLINE.md); the partition only as an optional bonus. The
    router's default before issue 21."""

    locality_weight: LocalityWeight = 0.0
    """Bonus per unit of partition score, in expert loads per step (0: no partition)."""
    prior_tokens: PriorTokens = PRIOR_TOKENS
    """Pseudo-tokens the demand prediction is smoothed with (`PRIOR_TOKENS`)."""
    top_k: TopK = 0
    """Experts per token per layer for the demand prediction; 0: estimated per request."""

    @property
    def pipeline(self) -> Pipeline:
        scorers: tuple[ScorerStage, ...] = (MarginalUnionCost(),)
        if self.locality_weight > 0:
            scorers += (CentroidCost(weight=self.locality_weight),)
        return Pipeline(scorers=scorers, picker=Cheapest(tolerance=COST_TOLERANCE))


class EldrBandCostProfile(_CostAware, frozen=True, tag="eldr_band_cost"):
    """The default: locality band and live activity together. Candidates: the live owners of
    the `nearest` centroids nearest the request's signature (the partition's index), plus
    workers without a centroid; filters: a load ceiling ((1 + slack) x the fleet's mean + 1),
    then the paper's band (`tau`, `widen_to`); scorer: the request's marginal expert union
    on each band member (what it adds to the fleet's decode cost, from the activity table);
    picker: the cheapest. The partition says which workers a request belongs with in the
    long run, the activity table which of them it costs least to join now, the ceiling
    keeps the tail (docs/ONLINE.md)."""

    tau: Tau = 0.1
    """Band width, cosine units (the paper's default)."""
    widen_to: WidenTo = 2
    """Workers a single-member band widens to (the paper's)."""
    slack: Slack = 0.2
    """Load ceiling: at most (1 + slack) x the live fleet's mean load + 1."""
    nearest: NearestK = NEAREST_K
    """Centroids retrieved per decision (the band holds at most this many scored workers)."""
    prior_tokens: PriorTokens = PRIOR_TOKENS
    """Pseudo-tokens the demand prediction is smoothed with (`PRIOR_TOKENS`)."""
    top_k: TopK = 0
    """Experts per token per layer for the demand prediction; 0: estimated per request."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(
            candidates=NearestCentroids(k=self.nearest),
            filters=(LoadCeiling(slack=self.slack), Band(tau=self.tau, widen_to=self.widen_to)),
            scorers=(MarginalUnionCost(),),
            picker=Cheapest(tolerance=COST_TOLERANCE),
        )


class PipelineProfile(_CostAware, frozen=True, tag="pipeline"):
    """A pipeline given as data, stage by stage (a new policy without new code), e.g.
    `{"policy": "pipeline", "filters": [{"stage": "band", "tau": 0.2}], "scorers":
    [{"stage": "marginal_union"}, {"stage": "load", "weight": 5}]}`."""

    candidates: CandidateStage = AllLive()
    filters: Annotated[tuple[FilterStage, ...], Meta(max_length=MAX_STAGES)] = ()
    scorers: Annotated[tuple[ScorerStage, ...], Meta(max_length=MAX_STAGES)] = (LoadCost(),)
    picker: PickerStage = Cheapest()
    prior_tokens: PriorTokens = PRIOR_TOKENS
    """Pseudo-tokens the demand prediction is smoothed with (`PRIOR_TOKENS`)."""
    top_k: TopK = 0
    """Experts per token per layer for the demand prediction; 0: estimated per request."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(
            candidates=self.candidates,
            filters=self.filters,
            scorers=self.scorers,
            picker=self.picker,
        )

    def params(self) -> dict[str, float | int | str]:
        return {
            "load_measure": self.load_measure,
            "prior_tokens": self.prior_tokens,
            "top_k": self.top_k,
            "stages": self.pipeline.describe(),
        }


class FixedAssignmentProfile(ProfileBase, frozen=True, tag="fixed_assignment"):
    """An assignment decided elsewhere, replayed (`eldr.core.routing.pipeline.
    FixedAssignment`): the benchmark's offline reference, compare-live's replay of the live
    router's choices. No parameters (the assignment is data) and not a `RoutingProfile`: a
    router never runs it."""


RoutingProfile: TypeAlias = (
    RoundRobinProfile
    | RandomProfile
    | JsqProfile
    | P2cProfile
    | EldrProfile
    | EldrBoundedProfile
    | EldrCostProfile
    | EldrBandCostProfile
    | PipelineProfile
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

DEFAULT_PROFILE: RoutingProfile = EldrBandCostProfile()
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
