"""Per-role NATS subject permissions: load `deploy/nats/permissions.yaml`, expand them for a
namespace, render them as nats-server configuration.

The YAML file is the one source of truth (its header documents the format); this module
resolves a role's grants and placeholders into plain subject lists, checks subjects the way
nats-server matches them (`allows`), and renders users for three consumers: a
nats-server `authorization` block (`nats_conf`), Helm values for the official NATS chart
(`helm_values`), both with passwords taken from environment variables that the server's
pod reads from Kubernetes Secrets. `eldr deploy nats-auth` (`eldr.deploy.cli`) writes them.

Stream names and the bucket come from `eldr.bus.topology`, so a stream added there is
covered by every `{stream}` subject here; which role may update which stream
(`{owned}`) comes from `eldr.bus.owners`, the map the services apply the topology by.
Each role has an inbox prefix of its own (`{inbox}`, `inbox_prefix`), which its clients
connect with (`ELDR_INBOX_PREFIX`), so no role can read or write another role's replies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eldr.bus.owners import owned_streams
from eldr.bus.topology import build_topology
from eldr.settings import NAMESPACE_PATTERN, RetentionSettings

SPEC_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PERMISSIONS_FILE = REPO_ROOT / "deploy" / "nats" / "permissions.yaml"

_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z]+)\}")
_PLACEHOLDERS = frozenset({"ns", "NS", "stream", "bucket", "id", "inbox", "owned"})
_PER_VALUE = ("stream", "owned", "id", "inbox")
"""Placeholders that repeat a subject once per value; a subject may hold only one of them
({inbox} of a per-instance role repeats per id)."""
INBOX_ROOT = "_INBOX"
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SET_KEYS = frozenset({"publish", "subscribe", "allow_responses"})
_ROLE_KEYS = _SET_KEYS | {"description", "per_instance", "include"}

Action = Literal["publish", "subscribe"]


class PermissionSpecError(ValueError):
    """The permissions file is malformed."""


@dataclass(frozen=True)
class Grant:
    """A set of subject patterns, with placeholders still in them."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    allow_responses: bool = False


@dataclass(frozen=True)
class Role:
    name: str
    description: str
    own: Grant
    include: tuple[str, ...] = ()
    per_instance: bool = False


@dataclass(frozen=True)
class PermissionSpec:
    grants: Mapping[str, Grant]
    roles: Mapping[str, Role]


@dataclass(frozen=True)
class Permissions:
    """A role's permissions for one namespace (and instance ids): concrete patterns."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool

    def allows(self, action: Action, subject: str) -> bool:
        """Whether nats-server would let this user publish / subscribe to `subject`."""
        patterns = self.publish if action == "publish" else self.subscribe
        return any(subject_matches(p, subject) for p in patterns)


@dataclass(frozen=True)
class NatsUser:
    """A NATS user of a deployment: a name, a role and, for per-instance roles, the ids."""

    name: str
    role: str
    instances: tuple[str, ...] = ()

    def inbox_prefix(self, namespace: str) -> str:
        """What this user's process sets as `ELDR_INBOX_PREFIX` (a per-instance user with
        several ids may use any of them; this is the first)."""
        return inbox_prefix(namespace, self.role, self.instances[0] if self.instances else None)

    @property
    def password_env(self) -> str:
        """Environment variable of the NATS server holding this user's password."""
        return "NATS_PW_" + re.sub(r"[^A-Za-z0-9]", "_", self.name).upper()

    @property
    def secret_name(self) -> str:
        """Kubernetes Secret with keys `user` and `password` (shared by the server's pod
        and the client's)."""
        return f"nats-{self.name}".lower().replace("_", "-").replace(".", "-")

    @classmethod
    def parse(cls, text: str) -> NatsUser:
        """`name=role` or `name=role:id1,id2` (the command-line form)."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"user {text!r}: expected NAME=ROLE or NAME=ROLE:ID[,ID...]")
        role, _, ids = rest.partition(":")
        instances = tuple(i.strip() for i in ids.split(",") if i.strip()) if ids else ()
        return cls(name=name, role=role, instances=instances)

    def spec(self) -> str:
        """The inverse of `parse`."""
        ids = ":" + ",".join(self.instances) if self.instances else ""
        return f"{self.name}={self.role}{ids}"


# --- loading --------------------------------------------------------------------------------


def load_permissions(path: Path | None = None) -> PermissionSpec:
    """Read and check the permissions file (default: deploy/nats/permissions.yaml)."""
    import yaml  # type: ignore[import-untyped]  # dev dependency, imported when used

    path = path or DEFAULT_PERMISSIONS_FILE
    with path.open(encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return parse_permissions(data)


def parse_permissions(data: object) -> PermissionSpec:
    """Check the structure of a loaded permissions document; raise PermissionSpecError."""
    if not isinstance(data, Mapping):
        raise PermissionSpecError("the permissions document must be a mapping")
    if data.get("version") != SPEC_VERSION:
        raise PermissionSpecError(f"version must be {SPEC_VERSION}, got {data.get('version')!r}")
    unknown = set(data) - {"version", "grants", "roles"}
    if unknown:
        raise PermissionSpecError(f"unknown top-level keys: {sorted(unknown)}")
    grants = {
        name: _grant(f"grant {name}", body, _SET_KEYS)
        for name, body in _mapping("grants", data.get("grants", {})).items()
    }
    roles: dict[str, Role] = {}
    for name, body in _mapping("roles", data.get("roles", {})).items():
        where = f"role {name}"
        body = _mapping(where, body)
        include = tuple(_strings(f"{where}: include", body.get("include", [])))
        missing = [g for g in include if g not in grants]
        if missing:
            raise PermissionSpecError(f"{where} includes undefined grants {missing}")
        per_instance = body.get("per_instance", False)
        if not isinstance(per_instance, bool):
            raise PermissionSpecError(f"{where}: per_instance must be true or false")
        description = body.get("description", "")
        if not isinstance(description, str) or not description.strip():
            raise PermissionSpecError(f"{where}: a description is required")
        own = _grant(where, body, _ROLE_KEYS)
        role = Role(name, " ".join(description.split()), own, include, per_instance)
        for pattern in _patterns_of(spec_grants=grants, role=role):
            if "{id}" in pattern and not per_instance:
                raise PermissionSpecError(f"{where}: {pattern} uses {{id}} but is not per_instance")
        roles[name] = role
    return PermissionSpec(grants=grants, roles=roles)


def _mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise PermissionSpecError(f"{where} must be a mapping with string keys")
    return value


def _strings(where: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PermissionSpecError(f"{where} must be a list of non-empty strings")
    return list(value)


def _grant(where: str, body: object, allowed_keys: frozenset[str]) -> Grant:
    body = _mapping(where, body)
    unknown = set(body) - allowed_keys
    if unknown:
        raise PermissionSpecError(f"{where}: unknown keys {sorted(unknown)}")
    publish = _strings(f"{where}: publish", body.get("publish", []))
    subscribe = _strings(f"{where}: subscribe", body.get("subscribe", []))
    for pattern in (*publish, *subscribe):
        _check_pattern(where, pattern)
    allow_responses = body.get("allow_responses", False)
    if not isinstance(allow_responses, bool):
        raise PermissionSpecError(f"{where}: allow_responses must be true or false")
    return Grant(tuple(publish), tuple(subscribe), allow_responses)


def _check_pattern(where: str, pattern: str) -> None:
    names = _PLACEHOLDER_RE.findall(pattern)
    unknown = set(names) - _PLACEHOLDERS
    if unknown:
        raise PermissionSpecError(f"{where}: {pattern} has unknown placeholders {sorted(unknown)}")
    repeated = [n for n in _PER_VALUE if n in names]
    if len(repeated) > 1:
        raise PermissionSpecError(
            f"{where}: {pattern} mixes {', '.join('{' + n + '}' for n in repeated)}"
        )
    if any(t == "" for t in pattern.split(".")) or " " in pattern:
        raise PermissionSpecError(f"{where}: {pattern!r} is not a subject")
    for token in pattern.split("."):
        if ">" in token and (token != ">" or not pattern.endswith(">")):
            raise PermissionSpecError(f"{where}: '>' must be the last token of {pattern}")
        if "*" in token and token != "*":
            raise PermissionSpecError(f"{where}: '*' must be a whole token in {pattern}")


def _patterns_of(spec_grants: Mapping[str, Grant], role: Role) -> Iterable[str]:
    for grant in (role.own, *(spec_grants[g] for g in role.include)):
        yield from grant.publish
        yield from grant.subscribe


# --- resolving ------------------------------------------------------------------------------


def inbox_prefix(namespace: str, role: str, instance: str | None = None) -> str:
    """The inbox prefix of `role` in `namespace` (`_INBOX.<ns>.<role>`, plus `.<id>` for an
    instance of a per-instance role): `{inbox}` in the permissions file, and what the
    role's clients connect with (`BusSettings.inbox_prefix`)."""
    parts = [INBOX_ROOT, namespace, role] + ([instance] if instance is not None else [])
    return ".".join(parts)


def stream_names(namespace: str) -> tuple[str, ...]:
    """Every stream of the namespace's topology (limits do not change names)."""
    return tuple(s.name for s in build_topology(namespace, RetentionSettings()).streams)


def resolve(
    spec: PermissionSpec, role: str, namespace: str, instances: Sequence[str] = ()
) -> Permissions:
    """The concrete permissions of `role` in `namespace` for instance ids `instances`."""
    if not re.match(NAMESPACE_PATTERN, namespace):
        raise ValueError(f"namespace {namespace!r} does not match {NAMESPACE_PATTERN}")
    if role not in spec.roles:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(sorted(spec.roles))})")
    r = spec.roles[role]
    if r.per_instance and not instances:
        raise ValueError(f"role {role} is per instance: give its instance ids")
    if not r.per_instance and instances:
        raise ValueError(f"role {role} is not per instance; it takes no ids")
    for instance in instances:
        if not _TOKEN_RE.match(instance):
            raise ValueError(f"instance id {instance!r} is not a subject-safe token")
    topology = build_topology(namespace, RetentionSettings())
    values = {
        "ns": namespace,
        "NS": namespace.upper(),
        "bucket": topology.partitions_bucket,
    }
    per_value = {
        "stream": [s.name for s in topology.streams],
        "owned": list(owned_streams(topology, role)),
        "id": list(instances),
        "inbox": [inbox_prefix(namespace, role, i) for i in instances]
        if r.per_instance
        else [inbox_prefix(namespace, role)],
    }
    grants = [r.own, *(spec.grants[g] for g in r.include)]

    def expand(patterns: Iterable[str]) -> tuple[str, ...]:
        out: list[str] = []
        for pattern in patterns:
            for variant in _expand_one(pattern, values, per_value):
                if variant not in out:
                    out.append(variant)
        return tuple(out)

    return Permissions(
        publish=expand(p for g in grants for p in g.publish),
        subscribe=expand(p for g in grants for p in g.subscribe),
        allow_responses=any(g.allow_responses for g in grants),
    )


def _expand_one(
    pattern: str, values: Mapping[str, str], per_value: Mapping[str, Sequence[str]]
) -> list[str]:
    variants = [pattern]
    for name in _PER_VALUE:
        token = "{" + name + "}"
        if token in pattern:
            variants = [pattern.replace(token, v) for v in per_value[name]]
            break
    return [_PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], v) for v in variants]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` matches one token, a final `>` one or more."""
    p_tokens, s_tokens = pattern.split("."), subject.split(".")
    for i, p in enumerate(p_tokens):
        if p == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens) or (p != "*" and p != s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)


# --- rendering ------------------------------------------------------------------------------


def user_entries(
    spec: PermissionSpec, namespace: str, users: Sequence[NatsUser]
) -> list[dict[str, Any]]:
    """nats-server `authorization.users` entries; passwords are `$ENV` references."""
    names = [u.name for u in users]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate user names in {names}")
    entries = []
    for user in users:
        if not _USER_RE.match(user.name):
            raise ValueError(f"user name {user.name!r} is not allowed")
        perms = resolve(spec, user.role, namespace, user.instances)
        permissions: dict[str, Any] = {
            "publish": _rule(perms.publish),
            "subscribe": _rule(perms.subscribe),
        }
        if perms.allow_responses:
            permissions["allow_responses"] = True
        entries.append(
            {"user": user.name, "password": "$" + user.password_env, "permissions": permissions}
        )
    return entries


def nats_conf(spec: PermissionSpec, namespace: str, users: Sequence[NatsUser]) -> str:
    """An `authorization { users = [...] }` block in nats-server configuration syntax."""
    lines = ["authorization {", "  users = ["]
    for entry in user_entries(spec, namespace, users):
        perms = entry["permissions"]
        lines.append("    {")
        lines.append(f"      user: {_quote(entry['user'])}")
        # An unquoted $NAME is resolved from the server's environment.
        lines.append(f"      password: {entry['password']}")
        lines.append("      permissions: {")
        for action in ("publish", "subscribe"):
            ((kind, subjects),) = perms[action].items()
            lines.append(f"        {action}: {{")
            lines.append(f"          {kind}: [")
            lines.extend(f"            {_quote(s)}" for s in subjects)
            lines.append("          ]")
            lines.append("        }")
        if perms.get("allow_responses"):
            lines.append("        allow_responses: true")
        lines.append("      }")
        lines.append("    }")
    lines.extend(["  ]", "}"])
    return "\n".join(lines) + "\n"


def _rule(subjects: Sequence[str]) -> dict[str, list[str]]:
    # nats-server reads an empty `allow` list as "no restriction": nothing allowed must be
    # said as "everything denied".
    return {"allow": list(subjects)} if subjects else {"deny": [">"]}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def helm_values(spec: PermissionSpec, namespace: str, users: Sequence[NatsUser]) -> dict[str, Any]:
    """Values for the official NATS chart: the users in `config.merge.authorization`
    (passwords as `<< $ENV >>`, which the chart writes unquoted) and the server container's
    environment filled from each user's Secret."""
    entries = user_entries(spec, namespace, users)
    for entry in entries:
        entry["password"] = "<< " + entry["password"] + " >>"
    env = {
        user.password_env: {
            "valueFrom": {"secretKeyRef": {"name": user.secret_name, "key": "password"}}
        }
        for user in users
    }
    return {
        "config": {"merge": {"authorization": {"users": entries}}},
        "container": {"env": env},
    }


def render(
    spec: PermissionSpec, namespace: str, users: Sequence[NatsUser], fmt: Literal["conf", "helm"]
) -> str:
    """The file `eldr deploy nats-auth` writes: a header naming the command that makes it
    again, then the configuration (NATS syntax or Helm values YAML)."""
    command = "eldr deploy nats-auth --format {} --namespace {} {}".format(
        fmt, namespace, " ".join(f"--user {u.spec()}" for u in users)
    )
    header = [
        "Generated from deploy/nats/permissions.yaml; do not edit. Regenerate with:",
        f"  {command.strip()}",
        "Each user's processes connect with its inbox prefix (ELDR_INBOX_PREFIX):",
        *(f"  {u.name}: {u.inbox_prefix(namespace)}" for u in users),
    ]
    if fmt == "conf":
        body = nats_conf(spec, namespace, users)
    else:
        import yaml

        body = yaml.safe_dump(
            helm_values(spec, namespace, users), sort_keys=False, default_flow_style=False
        )
    return "".join(f"# {line}\n" for line in header) + body


GENERATED_COMMAND_RE = re.compile(r"^#\s+eldr deploy nats-auth (?P<args>.+)$", re.MULTILINE)


def command_of(text: str) -> list[str]:
    """The `eldr deploy nats-auth` arguments recorded in a generated file's header."""
    match = GENERATED_COMMAND_RE.search(text)
    if match is None:
        raise ValueError("not a file written by `eldr deploy nats-auth`")
    return match.group("args").split()
