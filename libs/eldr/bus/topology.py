"""Streams, consumers, the object-store bucket and subject names, declared as data.

Everything here is plain data computed from a namespace and `RetentionSettings`; it
imports no NATS code. `eldr.bus.apply.apply_topology` makes the server match it.
The table in docs/ARCHITECTURE.md ("Services and data flow") is the contract this file
implements: change both together.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Literal

from eldr.settings import NAMESPACE_PATTERN, RetentionSettings
from eldr.wire import (
    BlockSummaryBatch,
    CaptureStatus,
    DecodeSummary,
    LoadReport,
    Message,
    PrefillDone,
    RequestFinished,
)

_NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")

Storage = Literal["file", "memory"]
Discard = Literal["old", "new"]
DeliverPolicy = Literal["all", "new"]

# Stream suffixes (the stream name is f"{NAMESPACE.upper()}_{suffix}").
BLOCKS = "BLOCKS"
PREFILL = "PREFILL"
DECISIONS = "DECISIONS"
LOAD = "LOAD"
PROFILES = "PROFILES"
FINISHED = "FINISHED"
PARTITIONS = "PARTITIONS"
DLQ = "DLQ"

ROUTER_CONSUMER = "router"
"""Durable pull consumer on PREFILL shared by all router replicas."""
SIGNATURE_QUEUE = "signature"
"""Queue group of the signature service on `{ns}.sig.assemble`."""

IDENTITY: dict[type[Message], str] = {
    BlockSummaryBatch: "worker_id",
    PrefillDone: "prefill_worker",
    LoadReport: "worker_id",
    DecodeSummary: "worker_id",
    RequestFinished: "gateway_id",
    CaptureStatus: "worker_id",
}
"""For each message that names its sender, the field that does: it must equal the last
token of the subject it came on (`blocks.<worker>`, `prefill.done.<worker>`,
`load.<worker>`, `profiles.<worker>`, `finished.<gateway>`, `capture.<worker>`), which is
what the sender's NATS permissions let it publish on. Readers pass it to the bus
(`identity=IDENTITY[LoadReport]`), which refuses any other (`identity_mismatch`)."""


def subject_token(value: str, what: str = "token") -> str:
    """Return `value` if it is usable as one subject token, else raise ValueError."""
    if not _TOKEN_RE.match(value):
        raise ValueError(f"{what} {value!r} is not a subject-safe token ([A-Za-z0-9_-]{{1,256}})")
    return value


def rid_token(request_id: str) -> str:
    """Subject-safe token for a request id: hex of its 128-bit BLAKE2b digest."""
    return hashlib.blake2b(request_id.encode("utf-8"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Subjects:
    """Subject names of one namespace. Worker ids must be subject-safe tokens."""

    namespace: str

    def __post_init__(self) -> None:
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} does not match {NAMESPACE_PATTERN}")

    def _s(self, *tokens: str) -> str:
        return ".".join((self.namespace, *tokens))

    def blocks(self, prefill_worker: str) -> str:
        return self._s("blocks", subject_token(prefill_worker, "worker id"))

    @property
    def blocks_all(self) -> str:
        return self._s("blocks", "*")

    def prefill_done(self, prefill_worker: str) -> str:
        return self._s("prefill", "done", subject_token(prefill_worker, "worker id"))

    @property
    def prefill_done_all(self) -> str:
        return self._s("prefill", "done", "*")

    @property
    def sig_assemble(self) -> str:
        return self._s("sig", "assemble")

    def decision(self, request_id: str) -> str:
        return self._s("decisions", rid_token(request_id))

    @property
    def decisions_all(self) -> str:
        return self._s("decisions", "*")

    def load(self, decode_worker: str) -> str:
        return self._s("load", subject_token(decode_worker, "worker id"))

    @property
    def load_all(self) -> str:
        return self._s("load", "*")

    def profiles(self, decode_worker: str) -> str:
        return self._s("profiles", subject_token(decode_worker, "worker id"))

    @property
    def profiles_all(self) -> str:
        return self._s("profiles", "*")

    def finished(self, gateway: str) -> str:
        """Where a gateway publishes the `RequestFinished` events of the requests it proxied."""
        return self._s("finished", subject_token(gateway, "gateway id"))

    @property
    def finished_all(self) -> str:
        return self._s("finished", "*")

    def capture(self, worker: str) -> str:
        """Where an engine's capture plugin publishes its `CaptureStatus`."""
        return self._s("capture", subject_token(worker, "worker id"))

    @property
    def capture_all(self) -> str:
        return self._s("capture", "*")

    @property
    def partition_active(self) -> str:
        return self._s("partition", "active")

    @property
    def control_router(self) -> str:
        return self._s("control", "router")

    @property
    def trainer_refit(self) -> str:
        return self._s("trainer", "refit")

    def sim_decode(self, decode_worker: str) -> str:
        """Simulated decode worker's job subject (development and tests only)."""
        return self._s("sim", "decode", subject_token(decode_worker, "worker id"))

    @property
    def sim_stats(self) -> str:
        return self._s("sim", "stats")

    def dlq(self, stream: str) -> str:
        return self._s("dlq", subject_token(stream, "stream name"))

    @property
    def dlq_all(self) -> str:
        return self._s("dlq", "*")

    def family(self, subject: str) -> str:
        """Bounded metric label for a subject: its tokens after the namespace, without
        the per-worker / per-request last token (`prefill.done`, `sig.assemble`, ...).
        Subjects outside the namespace (reply inboxes) are `other`."""
        prefix = self.namespace + "."
        if not subject.startswith(prefix):
            return "other"
        tokens = subject[len(prefix) :].split(".")
        head = tokens[0]
        if head in ("blocks", "decisions", "load", "profiles", "finished", "capture", "dlq"):
            return head
        if head == "prefill" and len(tokens) >= 2:
            return "prefill." + tokens[1]
        if head in ("sig", "partition", "control", "trainer", "sim") and len(tokens) >= 2:
            return head + "." + tokens[1]
        return "other"


@dataclass(frozen=True)
class StreamSpec:
    """One JetStream stream (limits retention)."""

    name: str
    subjects: tuple[str, ...]
    description: str
    max_age_s: float
    """0 = no age limit."""
    max_bytes: int
    storage: Storage
    replicas: int
    max_msgs: int = -1
    max_msgs_per_subject: int = -1
    max_msg_size_bytes: int = -1
    discard: Discard = "old"
    duplicate_window_s: float = 120.0
    allow_direct: bool = True
    """Direct gets (`Bus.get_last`) are served by any replica without the API leader."""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer with explicit acks."""

    stream: str
    durable: str
    description: str
    filter_subject: str
    ack_wait_s: float
    max_deliver: int
    max_ack_pending: int
    deliver_policy: DeliverPolicy = "all"


@dataclass(frozen=True)
class ObjectStoreSpec:
    bucket: str
    description: str
    max_bytes: int
    storage: Storage
    replicas: int

    @property
    def stream_name(self) -> str:
        """The stream NATS keeps the bucket in."""
        return f"OBJ_{self.bucket}"


@dataclass(frozen=True)
class Topology:
    namespace: str
    subjects: Subjects
    streams: tuple[StreamSpec, ...]
    consumers: tuple[ConsumerSpec, ...]
    object_stores: tuple[ObjectStoreSpec, ...] = field(default=())

    def stream_name(self, suffix: str) -> str:
        """Full stream name for a suffix such as `BLOCKS`."""
        return stream_name(self.namespace, suffix)

    @property
    def partitions_bucket(self) -> str:
        return f"{self.namespace}-partitions"


def stream_name(namespace: str, suffix: str) -> str:
    return f"{namespace.upper()}_{suffix}"


def build_topology(namespace: str, retention: RetentionSettings) -> Topology:
    """The streams, consumers and bucket of `namespace`, sized by `retention`."""
    subjects = Subjects(namespace)
    r = retention

    def stream(
        suffix: str,
        subject: str,
        description: str,
        *,
        max_age_s: float,
        max_bytes: int,
        max_msgs_per_subject: int = -1,
    ) -> StreamSpec:
        return StreamSpec(
            name=stream_name(namespace, suffix),
            subjects=(subject,),
            description=description,
            max_age_s=max_age_s,
            max_bytes=max_bytes,
            max_msgs_per_subject=max_msgs_per_subject,
            storage=r.stream_storage,
            replicas=r.stream_replicas,
            duplicate_window_s=r.duplicate_window_s,
        )

    streams = (
        stream(
            BLOCKS,
            subjects.blocks_all,
            "Per-KV-block expert-count summaries from prefill workers",
            max_age_s=r.blocks_max_age_s,
            max_bytes=r.blocks_max_bytes,
        ),
        stream(
            PREFILL,
            subjects.prefill_done_all,
            "Prefill-finished events awaiting a decode worker",
            max_age_s=r.prefill_max_age_s,
            max_bytes=r.prefill_max_bytes,
        ),
        stream(
            DECISIONS,
            subjects.decisions_all,
            "Routing decisions, first write per request id wins",
            max_age_s=r.decisions_max_age_s,
            max_bytes=r.decisions_max_bytes,
        ),
        stream(
            LOAD,
            subjects.load_all,
            "Decode-worker load reports (recorded core publishes)",
            max_age_s=r.load_max_age_s,
            max_bytes=r.load_max_bytes,
        ),
        stream(
            PROFILES,
            subjects.profiles_all,
            "Decode expert-count profiles of finished requests",
            max_age_s=r.profiles_max_age_s,
            max_bytes=r.profiles_max_bytes,
        ),
        stream(
            FINISHED,
            subjects.finished_all,
            "Requests that left a decode worker, from the gateways (recorded core publishes)",
            max_age_s=r.finished_max_age_s,
            max_bytes=r.finished_max_bytes,
        ),
        stream(
            PARTITIONS,
            subjects.partition_active,
            "Active-partition announcements (history of recent versions)",
            max_age_s=0.0,
            max_bytes=64 << 20,
            max_msgs_per_subject=r.partitions_history,
        ),
        stream(
            DLQ,
            subjects.dlq_all,
            "Messages the bus could not process",
            max_age_s=r.dlq_max_age_s,
            max_bytes=r.dlq_max_bytes,
        ),
    )
    consumers = (
        ConsumerSpec(
            stream=stream_name(namespace, PREFILL),
            durable=ROUTER_CONSUMER,
            description="Routers: each PrefillDone goes to one router replica",
            filter_subject=subjects.prefill_done_all,
            ack_wait_s=r.router_ack_wait_s,
            max_deliver=r.router_max_deliver,
            max_ack_pending=r.router_max_ack_pending,
        ),
    )
    object_stores = (
        ObjectStoreSpec(
            bucket=f"{namespace}-partitions",
            description="Partition blobs (eldr.wire.PartitionBlob), one object per version",
            max_bytes=r.partitions_max_bytes,
            storage=r.stream_storage,
            replicas=r.stream_replicas,
        ),
    )
    return Topology(
        namespace=namespace,
        subjects=subjects,
        streams=streams,
        consumers=consumers,
        object_stores=object_stores,
    )
