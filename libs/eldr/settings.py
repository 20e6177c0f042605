"""Typed settings, read from `ELDR_*` environment variables (the only place that reads them).

`BusSettings` says how to reach NATS and how much to accept from it; `RetentionSettings`
sizes the JetStream streams; `CommonSettings` adds what every service process has (log
level, metrics port, instance id); `GeometrySettings` (routers, signature replicas, the
trainer) says which model geometries to accept, `BlockHashSettings` (producers of block
hashes) the deployment's block-hash key. Each service subclasses `CommonSettings` with its own
fields, so one flat `ELDR_` namespace configures a process, e.g. `ELDR_NATS_URL`,
`ELDR_NAMESPACE`, `ELDR_DECISIONS_MAX_AGE_S`. `RoutingSettings` (routers, and the trainer,
whose shadow gate routes as the routers do) is the routing profile: `ELDR_ROUTING_PROFILE`.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import msgspec
from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from eldr.core.limits import (
    DEFAULT_MAX_CELLS,
    DEFAULT_MAX_EXPERTS,
    DEFAULT_MAX_MOE_LAYERS,
    GeometryLimits,
    parse_model_geometries,
)
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    ROUTER_POLICIES,
    LoadMeasure,
    ProfileBase,
    RoutingProfile,
    decode_profile,
    profile_from_params,
)
from eldr.core.signature.blocks import hash_key_from_secret
from eldr.wire.base import MAX_EXPERTS, MAX_MOE_LAYERS, MAX_SPARSE_CELLS

NAMESPACE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
"""Lower case so that upper-cased stream names (`ELDR_BLOCKS`) cannot collide; no dots
(it is one subject token); short, because it prefixes stream and bucket names."""

INBOX_PREFIX_PATTERN = r"^_INBOX(\.[A-Za-z0-9_-]{1,128}){0,4}$"
"""`_INBOX` or `_INBOX.<token>...`: what nats-py puts before `.<unique id>` in an inbox."""

_CONFIG = SettingsConfigDict(env_prefix="ELDR_", extra="forbid", validate_default=True)


class BusSettings(BaseSettings):
    """How to reach NATS, authenticate, and bound what is accepted from it."""

    model_config = _CONFIG

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        description="NATS server URL; several may be given separated by commas.",
    )
    namespace: str = Field(
        default="eldr",
        pattern=NAMESPACE_PATTERN,
        description="Prefix of every subject, stream and bucket; tests use one per test.",
    )
    connect_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Timeout of one connect attempt (a reconnect that picks a hung server "
        "moves on to the next after this).",
    )
    startup_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="How long the first connect keeps retrying (NATS may start later).",
    )
    reconnect_wait_s: float = Field(
        default=0.5, gt=0, description="Pause between reconnect attempts."
    )
    max_reconnect_attempts: int = Field(
        default=-1, ge=-1, description="Reconnect attempts before giving up; -1 retries forever."
    )
    ping_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="Interval of client keep-alive pings. With max_outstanding_pings a hung "
        "server (frozen, its host stalled: the socket stays open) is left for another "
        "node of the cluster after 2 s (3 s when the reconnect first tries the frozen node; "
        "measured, docs/RELIABILITY.md; 10 s x 3 took 42 s).",
    )
    max_outstanding_pings: int = Field(
        default=3,
        ge=1,
        description="Unanswered pings after which the connection counts as stale and the "
        "client reconnects, to another server where the URL lists several.",
    )
    request_timeout_s: float = Field(
        default=2.0, gt=0, description="Default timeout of requests and JetStream API calls."
    )
    drain_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Bound on a graceful drain (handlers finishing, acks flushed).",
    )
    fetch_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Long-poll expiry of one pull-consumer fetch; also bounds how long a "
        "drain waits for an idle consumer loop.",
    )
    replay_heartbeat_s: float = Field(
        default=2.0,
        gt=0,
        description="Idle heartbeat of ordered read-backs (`Bus.read_back`): a read-back whose "
        "consumer was lost (a NATS restart) notices within two heartbeats and resumes where it "
        "was.",
    )
    max_payload_bytes: int = Field(
        default=1 << 20,
        gt=0,
        description="Messages larger than this are rejected before decoding.",
    )
    max_object_bytes: int = Field(
        default=256 << 20, gt=0, description="Largest object-store object that will be read."
    )

    user: str | None = Field(default=None, description="NATS user name (with password).")
    password: SecretStr | None = Field(default=None, description="NATS password.")
    token: SecretStr | None = Field(default=None, description="NATS authentication token.")
    nkeys_seed_file: Path | None = Field(
        default=None, description="File holding an NKEY seed (needs the `nkeys` package)."
    )
    creds_file: Path | None = Field(
        default=None, description="NATS credentials file (JWT + seed; needs the `nkeys` package)."
    )
    tls_ca_file: Path | None = Field(
        default=None, description="CA bundle to verify the server with."
    )
    tls_cert_file: Path | None = Field(
        default=None, description="Client certificate for mutual TLS."
    )
    tls_key_file: Path | None = Field(default=None, description="Private key of tls_cert_file.")
    tls_hostname: str | None = Field(
        default=None, description="Server name to verify, when it differs from the URL's host."
    )
    inbox_prefix: str = Field(
        default="_INBOX",
        pattern=INBOX_PREFIX_PATTERN,
        description="Prefix of this client's reply inboxes. Under the generated NATS "
        "permissions a user may use only its role's, `_INBOX.<namespace>.<role>` "
        "(`.<worker id>` added for per-worker roles); `eldr deploy nats-auth` names it per user.",
    )
    require_auth: bool = Field(
        default=False,
        description="Refuse a NATS server that does not ask clients to authenticate (the "
        "production overlay sets it: NATS installed without its users is an error, not an "
        "open bus).",
    )

    @model_validator(mode="after")
    def _check_auth(self) -> BusSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.password is not None and self.user is None:
            raise ValueError("password given without user")
        return self


class RetentionSettings(BaseSettings):
    """Limits of the JetStream streams (see `eldr.bus.topology`)."""

    model_config = _CONFIG

    stream_storage: Literal["file", "memory"] = Field(
        default="file", description="Storage of every stream and of the object store."
    )
    stream_replicas: int = Field(default=1, ge=1, le=5, description="Replicas of every stream.")
    blocks_max_age_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        description="Block-summary retention: a block older than this is forgotten by "
        "restarting signature replicas (which replay BLOCKS).",
    )
    blocks_max_bytes: int = Field(default=1 << 30, gt=0, description="Size cap of BLOCKS.")
    prefill_max_age_s: float = Field(
        default=900.0,
        gt=0,
        description="PrefillDone retention; older events are of no use to route.",
    )
    prefill_max_bytes: int = Field(default=256 << 20, gt=0, description="Size cap of PREFILL.")
    decisions_max_age_s: float = Field(
        default=7 * 86400.0, gt=0, description="Decision retention (replay, training, audits)."
    )
    decisions_max_bytes: int = Field(default=1 << 30, gt=0, description="Size cap of DECISIONS.")
    load_max_age_s: float = Field(default=600.0, gt=0, description="LoadReport retention.")
    load_max_bytes: int = Field(default=128 << 20, gt=0, description="Size cap of LOAD.")
    profiles_max_age_s: float = Field(
        default=7 * 86400.0, gt=0, description="DecodeSummary retention."
    )
    profiles_max_bytes: int = Field(default=1 << 30, gt=0, description="Size cap of PROFILES.")
    finished_max_age_s: float = Field(
        default=3600.0, gt=0, description="RequestFinished retention (recorded core publishes)."
    )
    finished_max_bytes: int = Field(default=256 << 20, gt=0, description="Size cap of FINISHED.")
    partitions_history: int = Field(
        default=64, ge=1, description="Partition announcements kept on `{ns}.partition.active`."
    )
    partitions_max_bytes: int = Field(
        default=4 << 30, gt=0, description="Size cap of the partition object-store bucket."
    )
    dlq_max_age_s: float = Field(default=7 * 86400.0, gt=0, description="Dead-letter retention.")
    dlq_max_bytes: int = Field(default=256 << 20, gt=0, description="Size cap of DLQ.")
    duplicate_window_s: float = Field(
        default=120.0, gt=0, description="JetStream de-duplication window for Nats-Msg-Id."
    )
    router_ack_wait_s: float = Field(
        default=10.0, gt=0, description="Redeliver a PrefillDone not acked by a router within this."
    )
    router_max_deliver: int = Field(
        default=5, ge=1, description="Deliveries of a PrefillDone before it is dead-lettered."
    )
    router_max_ack_pending: int = Field(
        default=4096, ge=1, description="PrefillDone events in flight across all router replicas."
    )


class BlockHashSettings(BaseSettings):
    """The deployment secret block hashes are keyed with (`eldr.core.signature.blocks`): every
    producer of block hashes (capture plugin, gateway with the routed_experts source,
    simulated prefill) of a deployment must have the same one."""

    model_config = _CONFIG

    block_hash_key: SecretStr | None = Field(
        default=None,
        description="Secret the chained block hashes are keyed with (BLAKE2b keyed mode), so "
        "that a block hash cannot be computed from tokens, or linked to them, without it. "
        "Unset (and no block_hash_key_file): unkeyed hashes.",
    )
    block_hash_key_file: Path | None = Field(
        default=None,
        description="File holding the block-hash secret (a Kubernetes Secret mounted as a "
        "file); wins over block_hash_key.",
    )

    def block_hash_key_bytes(self) -> bytes:
        """The key producers hash with (empty: unkeyed)."""
        if self.block_hash_key_file is not None:
            secret = self.block_hash_key_file.read_bytes().strip()
        elif self.block_hash_key is not None:
            secret = self.block_hash_key.get_secret_value().encode()
        else:
            return b""
        return hash_key_from_secret(secret)


class GeometrySettings(BaseSettings):
    """Which model geometries a service that densifies expert counts accepts (routers,
    signature replicas, the trainer); see `eldr.core.limits`."""

    model_config = _CONFIG

    max_moe_layers: int = Field(
        default=DEFAULT_MAX_MOE_LAYERS,
        ge=1,
        le=MAX_MOE_LAYERS,
        description="Events declaring more MoE layers are refused before anything is "
        "allocated for them.",
    )
    max_experts: int = Field(
        default=DEFAULT_MAX_EXPERTS,
        ge=1,
        le=MAX_EXPERTS,
        description="Events declaring more experts per MoE layer are refused.",
    )
    max_signature_cells: int = Field(
        default=DEFAULT_MAX_CELLS,
        ge=1,
        le=MAX_SPARSE_CELLS,
        description="Events declaring more MoE layers x experts are refused (DeepSeek-V3: "
        "58 x 256 = 14,848). A router's decision records carry the signature, so this also "
        "bounds their size (see max_workers).",
    )
    model_geometries: str = Field(
        default="",
        description="The models served and their geometry, `model=LAYERSxEXPERTS` "
        "comma-separated (`qwen3-30b-a3b=48x128`): a listed model's events must have exactly "
        "that geometry. Empty: any model within the caps above.",
    )
    only_listed_models: bool = Field(
        default=False,
        description="Refuse events of models model_geometries does not list.",
    )

    @field_validator("model_geometries")
    @classmethod
    def _geometries(cls, value: str) -> str:
        parse_model_geometries(value)
        return value

    def geometry_limits(self) -> GeometryLimits:
        return GeometryLimits(
            max_moe_layers=self.max_moe_layers,
            max_experts=self.max_experts,
            max_cells=self.max_signature_cells,
            models=parse_model_geometries(self.model_geometries),
            only_listed=self.only_listed_models,
        )


def _routing_profile(value: Any) -> ProfileBase:
    """A profile from its JSON (the environment), a dict of it, or a profile."""
    if isinstance(value, ProfileBase):
        return value
    if isinstance(value, str | bytes):
        return decode_profile(value)
    try:
        profile: ProfileBase = msgspec.convert(value, RoutingProfile)
    except msgspec.ValidationError as exc:
        raise ValueError(f"routing profile {value!r}: {exc}") from None
    return profile


class RoutingSettings(BaseSettings):
    """How requests are routed: the routers route with it, and the trainer's shadow gate
    judges a candidate partition by routing with it, so both must get the same values
    (one ConfigMap in deploy/)."""

    model_config = SettingsConfigDict(**_CONFIG, arbitrary_types_allowed=True)

    routing_profile: Annotated[ProfileBase, BeforeValidator(_routing_profile)] = Field(
        default=DEFAULT_PROFILE,
        description="The routing policy and its parameters as JSON, e.g. "
        '`{"policy": "eldr", "tau": 0.2}`; parameters left out take their defaults '
        "(eldr.core.routing.profile). Policies: "
        f"{', '.join(ROUTER_POLICIES)} (oracle is for benchmarks only). Default "
        f"{DEFAULT_PROFILE.name}: cost-model-aware locality "
        "(docs/ONLINE.md); eldr is the ELDR paper's band rule.",
    )
    policy: str | None = Field(
        default=None,
        description="Older spelling: switch routing_profile to this policy (the "
        "parameters it takes carry over).",
    )
    tau: float | None = Field(
        default=None,
        description="Older spelling: the profile's tau (band policies only).",
    )
    load_measure: LoadMeasure | None = Field(
        default=None,
        description="Older spelling: the profile's load_measure (not round_robin, random).",
    )

    def legacy_params(self) -> dict[str, object]:
        """The older settings that are set, as profile parameters."""
        pairs = (("tau", self.tau), ("load_measure", self.load_measure))
        return {k: v for k, v in pairs if v is not None}

    @model_validator(mode="after")
    def _apply_legacy(self) -> Self:
        # The older variables keep working: they patch the profile, through the one
        # mapping of loose names onto a profile (a parameter the policy does not take is
        # an error that names what it takes).
        params = self.legacy_params()
        if self.policy is not None or params:
            self.routing_profile = profile_from_params(
                self.policy or self.routing_profile.name, params, keep=self.routing_profile
            )
        return self


def _default_instance_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class CommonSettings(BusSettings, RetentionSettings):
    """Settings every service process has; service settings subclass this."""

    model_config = _CONFIG

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Root log level."
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint; 0 = off."
    )
    metrics_host: str = Field(
        default="0.0.0.0",
        min_length=1,
        description="Address the /metrics, /healthz and /readyz endpoint binds (all "
        "interfaces, for a scraper in another pod; the local stack uses 127.0.0.1).",
    )
    instance_id: str = Field(
        default_factory=_default_instance_id,
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="Identity of this process (router_id, worker id, metrics); defaults "
        "to host-pid-random.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value
