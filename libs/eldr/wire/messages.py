"""Every message that travels on the bus (see docs/ARCHITECTURE.md, "Services and data flow").

Each top-level type is a frozen msgspec Struct with a `kind` tag and a schema version `v`
(from `Message`); nested types (`BlockSummaryMsg`, arrays) carry neither. Field docs say
what a field means and its unit. Evolution rule: append fields with defaults, bump `v`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from eldr.core.routing.profile import ProfileBase, RoutingProfile, profile_from_params
from eldr.wire.arrays import NdArray, SparseCounts
from eldr.wire.base import (
    MAX_ABS_FLOAT,
    MAX_ADMITTED,
    MAX_ATTR_VALUE_LEN,
    MAX_ATTRS,
    MAX_BLOCKS_PER_BATCH,
    MAX_DEAD_LETTER_PAYLOAD_BYTES,
    MAX_HEADERS,
    MAX_ID_LEN,
    MAX_METRICS,
    MAX_MISSING_LISTED,
    MAX_PARAMS,
    MAX_SCORES,
    MAX_WAIT_MS,
    MAX_WORKERS,
    U64,
    BlockHashes,
    BlockSize,
    Count,
    DurationS,
    FiniteFloat,
    Ident,
    Message,
    NumExperts,
    NumMoeLayers,
    Positive,
    Sha256Hex,
    Text,
    TimestampS,
    Token,
    Version,
    WorkerList,
    require,
)

AttrKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
AttrValue = Annotated[str, msgspec.Meta(max_length=MAX_ATTR_VALUE_LEN)]
ParamValue = FiniteFloat | int | Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
CaptureOutcome = Literal["captured", "inexact", "unavailable"]
"""How a PrefillDone's signature was captured: "captured" (exact), "inexact" (a cache hit
inside the trailing partial block: the computed counts miss those tokens), "unavailable"
(nothing was captured: no block hashes, no counts; routers route load-only at once)."""
SignatureSource = Literal["event", "computed", "service", "partial_only", "none"]
"""Where a router finds a request's counts (`PrefillDone.signature_source`)."""
FinishReason = Literal["stop", "length", "abort", "error", "moved"]
"""Why a request left a decode worker (`RequestFinished`): the decode finished ("stop",
"length"), the client went away ("abort"), the decode failed ("error"), or the request was
sent to another worker before it started ("moved")."""
DecisionOutcome = Literal["assigned", "expired"]
"""What a `Decision` record says: "assigned" (the request goes to `worker_id`) or
"expired" (the router saw the event after its `deadline_s`: the requester had given up
waiting, so no worker was assigned and no load counted; `worker_id` is `NO_WORKER`)."""
NO_WORKER = "-"
"""`Decision.worker_id` of an expired record; never a decode worker's id."""
CaptureState = Literal["ok", "off", "failed"]
"""What a capture plugin can do for one role: "ok", "off" (not configured for it),
"failed" (configured but cannot capture; `CaptureStatus.reason` says why)."""
ClientRequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
"""The id a client gave its request (its `X-Request-Id`): a label only. Every record is
keyed by the gateway's own `request_id`, one per client request, so that two clients (or
one client twice) sending the same id never share a decision."""
ScoredWorker = tuple[Token, FiniteFloat]
WorkerLoads = tuple[Token, Count, Count]
"""(worker, in-flight requests, KV tokens)."""
ConsideredWorker = tuple[
    Token, Count, Count, FiniteFloat | None, FiniteFloat | None, FiniteFloat | None
]
"""What a decision read of one candidate: (worker, in-flight requests, KV tokens, partition
score or None without a centroid, predicted expert union per step U and what the request
adds to it dU, both None where the marginal-union scorer did not read them)."""


def _require_shape(counts: SparseCounts | None, n_layers: int, n_experts: int, what: str) -> None:
    if counts is not None:
        require(
            counts.shape == [n_layers, n_experts],
            f"{what} has shape {counts.shape}, expected [{n_layers}, {n_experts}]",
        )


# --- prefill side ------------------------------------------------------------------------


class BlockSummaryMsg(msgspec.Struct, frozen=True):
    """Expert counts of one full, cacheable KV block."""

    block_hash: U64
    """Chained 64-bit block hash (`eldr.core.signature.blocks`), identical across processes."""
    parent_hash: U64 | None
    """Hash of the previous block of the same sequence; None for a sequence's first block."""
    n_tokens: Positive
    """Tokens in the block (= the batch's block_size for a full block)."""
    counts: SparseCounts
    """How many of the block's tokens routed to expert e at MoE layer l, [L, E]."""


class BlockSummaryBatch(Message, frozen=True, tag="block_summary_batch"):
    """New block summaries from one prefill worker, batched per engine step.

    Published on `{ns}.blocks.{worker_id}` (stream BLOCKS). Delivery is at-least-once and
    ordered per publisher; `seq` lets a consumer detect gaps and duplicates.
    """

    worker_id: Token
    """Publishing prefill worker."""
    seq: U64
    """Per-publisher sequence number, +1 per batch, restarting at 0 with the process."""
    ts_s: TimestampS
    """Publisher's wall clock when the batch was built, Unix seconds."""
    model: Ident
    num_moe_layers: NumMoeLayers
    num_experts: NumExperts
    block_size: BlockSize
    """Tokens per KV block."""
    blocks: Annotated[list[BlockSummaryMsg], msgspec.Meta(max_length=MAX_BLOCKS_PER_BATCH)]

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        for i, block in enumerate(self.blocks):
            require(
                block.n_tokens <= self.block_size,
                f"blocks[{i}] has {block.n_tokens} tokens, block_size is {self.block_size}",
            )
            _require_shape(block.counts, self.num_moe_layers, self.num_experts, f"blocks[{i}]")


class PrefillDone(Message, frozen=True, kw_only=True, tag="prefill_done"):
    """A request finished prefill and waits for a decode worker.

    Published on `{ns}.prefill.done.{prefill_worker}` (stream PREFILL); consumed by one
    router replica through the durable consumer `router`. v2 added `capture`, v3
    `deadline_s`, v4 `signature`, v5 `client_request_id`.

    Where a router finds the request's counts (`signature_source`): in the event itself
    (`signature`: the prefill worker held a summary of every block it took from its prefix
    cache, so the whole prompt's counts travel with the event; or `computed` with no
    prefix hit), else from the signature service for the cached blocks it names (blocks
    this instance did not compute: KV loaded from another worker or an external cache, or
    a summary its bounded local store had evicted) plus `computed`.
    """

    request_id: Ident
    model: Ident
    prefill_worker: Token
    ts_s: TimestampS
    """When prefill finished, Unix seconds (prefill worker's clock)."""
    block_size: BlockSize
    block_hashes: BlockHashes
    """Chained hashes of the prompt's full blocks, in order (n_prompt_tokens // block_size)."""
    n_prompt_tokens: Count
    partial: SparseCounts | None
    """Counts of the trailing partial block (never cached); None if the prompt ends on a
    block boundary or the producer could not summarise it."""
    num_moe_layers: NumMoeLayers
    num_experts: NumExperts
    reply_to: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)] | None = None
    """Core subject on which the requester waits for the `Decision`; None: nobody waits."""
    prefill_s: DurationS | None = None
    """Prefill duration in seconds, when the producer measured it."""
    max_tokens: Count | None = None
    """The request's decode budget (tokens), if known; a hint for load accounting."""
    attrs: Annotated[dict[AttrKey, AttrValue], msgspec.Meta(max_length=MAX_ATTRS)] = msgspec.field(
        default_factory=dict
    )
    """Small free-form labels (workload label, tenant) for replay and analysis."""
    cached_prefix_blocks: Count = 0
    """How many leading `block_hashes` were prefix-cache hits, i.e. not computed (and so not
    routed) by this prefill. Prefix caching reuses prefixes, so the hits always lead."""
    computed: SparseCounts | None = None
    """Expert counts of everything this prefill computed: the full blocks after the cached
    prefix plus the trailing partial block. When set, a router adds the signature service's
    sum over the cached prefix only (none at all when nothing was cached); when None (and
    `signature` is None too), it asks for every block and adds `partial`. Never set
    together with `signature`."""
    capture: CaptureOutcome = "captured"
    """Whether the producer captured the prompt's routing (`CaptureOutcome`). With
    "unavailable" (a prefill instance whose capture is off or failed, reported by the
    gateway) the event carries no block hashes and no counts."""
    deadline_s: TimestampS | None = None
    """Unix seconds after which the requester no longer waits for the decision (it falls
    back to its own choice): the producer's clock at publish plus the requester's decision
    budget. A router that takes the event later records an "expired" decision instead of
    assigning a worker. None: no deadline. v3."""
    signature: SparseCounts | None = None
    """The whole prompt's expert counts, [L, E]: the cached prefix blocks, everything this
    prefill computed and the trailing partial block (`partial` is kept, informational).
    Set by a prefill worker that holds its own summary of every block it took from its
    prefix cache (`eldr.vllm.capture`), so a router needs no signature-service lookup;
    `computed` is then None (it is a part of this). None: as before v4 (`computed`, the
    service for the cached blocks). v4."""
    client_request_id: ClientRequestId | None = None
    """The client's own id for the request (its `X-Request-Id`), a label for finding the
    records of a client request; `request_id` is the gateway's, unique per request. v5."""
    v: Version = 5

    @property
    def signature_source(self) -> SignatureSource:
        """Where a router finds this request's counts: "event" (`signature`), "computed"
        (no prefix-cache hit: `computed` is all of it), "service" (the signature service
        sums some of the blocks), "partial_only" (a prompt shorter than one block: its
        `partial`), "none" (nothing captured)."""
        if self.capture == "unavailable":
            return "none"
        if self.signature is not None:
            return "event"
        if self.computed is not None:
            return "service" if self.cached_prefix_blocks else "computed"
        if self.block_hashes:
            return "service"
        return "partial_only" if self.partial is not None else "none"

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        require(
            self.cached_prefix_blocks <= len(self.block_hashes),
            f"cached_prefix_blocks {self.cached_prefix_blocks} > {len(self.block_hashes)} blocks",
        )
        _require_shape(self.computed, self.num_moe_layers, self.num_experts, "computed")
        _require_shape(self.signature, self.num_moe_layers, self.num_experts, "signature")
        require(
            self.signature is None or self.computed is None,
            "a PrefillDone carries `signature` (the whole prompt) or `computed`, not both",
        )
        if self.capture == "unavailable":
            require(
                not self.block_hashes
                and self.computed is None
                and self.partial is None
                and self.signature is None,
                "a PrefillDone with capture 'unavailable' carries no block hashes or counts",
            )
            return
        require(
            len(self.block_hashes) == self.n_prompt_tokens // self.block_size,
            f"{len(self.block_hashes)} block hashes for {self.n_prompt_tokens} prompt tokens "
            f"at block size {self.block_size}",
        )
        require(
            self.partial is None or self.n_prompt_tokens % self.block_size != 0,
            "partial counts given but the prompt ends on a block boundary",
        )
        _require_shape(self.partial, self.num_moe_layers, self.num_experts, "partial")


# --- signature assembly (core request/reply on {ns}.sig.assemble) ------------------------


class AssembleRequest(Message, frozen=True, kw_only=True, tag="assemble_request"):
    """Router -> signature service: sum the cached counts of these blocks (plus `partial`)."""

    request_id: Ident
    model: Ident
    """Block hashes are per model: the cache is keyed by (model, block hash)."""
    block_hashes: BlockHashes
    partial: SparseCounts | None
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_MS)]
    """How long the service may wait for summaries still in flight before answering."""
    prefill_worker: Token | None = None
    """The request's prefill worker: where its own summary of a block differs from the
    one cached for everyone, its own is used (`eldr.core.signature.blockcache`). None: the shared
    summaries. v2."""
    v: Version = 2


class AssembleReply(Message, frozen=True, tag="assemble_reply"):
    """The request's prefill expert counts, summed over the blocks found."""

    request_id: Ident
    counts: NdArray | None
    """uint32 [L, E]; None when no block was found and no partial was given, or on error."""
    blocks_total: Count
    blocks_found: Count
    missing: Annotated[list[U64], msgspec.Meta(max_length=MAX_MISSING_LISTED)]
    """Hashes not found (the first MAX_MISSING_LISTED); blocks_total - blocks_found is exact."""
    error: Text | None = None

    def __post_init__(self) -> None:
        require(
            self.blocks_found <= self.blocks_total,
            f"blocks_found {self.blocks_found} > blocks_total {self.blocks_total}",
        )
        if self.counts is not None:
            require(
                self.counts.dtype == "uint32" and len(self.counts.shape) == 2,
                f"counts must be uint32 [L, E], got {self.counts.dtype} {self.counts.shape}",
            )


# --- routing ------------------------------------------------------------------------------


class Decision(Message, frozen=True, kw_only=True, tag="decision"):
    """Where a request goes, and why.

    Published on `{ns}.decisions.{rid}` (stream DECISIONS) with expected last subject
    sequence 0, so the first decision for a request id wins; also sent to `reply_to`.
    """

    request_id: Ident
    ts_s: TimestampS
    router_id: Ident
    model: Ident
    worker_id: Token
    """Chosen decode worker."""
    policy: Ident
    """The policy's name (`profile`'s tag from v3 on)."""
    params: Annotated[dict[AttrKey, ParamValue], msgspec.Meta(max_length=MAX_PARAMS)] = (
        msgspec.field(default_factory=dict)
    )
    """Policy parameters in force, untyped: records before v3 (`routing_profile` maps them
    onto a profile); empty from v3 on, where `profile` holds them."""
    partition_version: Version | None
    """Partition the decision used; None for policies that need none."""
    fallback: Text | None
    """Why the policy fell back (e.g. "no_partition", "signature_timeout"); None if it did not."""
    scores: Annotated[list[ScoredWorker], msgspec.Meta(max_length=MAX_SCORES)]
    """Top candidates by locality score, best first."""
    band: WorkerList
    """Workers within tau of the best score (the locality band)."""
    loads: Annotated[list[ScoredWorker], msgspec.Meta(max_length=MAX_WORKERS)]
    """The load measure of the workers considered, as the router saw it."""
    signature: SparseCounts | None
    """The request's prefill expert counts, for replay and the trainer."""
    missing_blocks: Count
    """Full blocks whose summaries the signature service did not have."""
    decide_s: DurationS
    """Time from taking the PrefillDone to building this decision (its publish not
    included), seconds."""
    rng_seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    """Seed of the decision's own generator (`eldr.core.routing.decide.DecisionRng`), which drew
    every tie-break and random choice of this decision: a replay re-creates them from it.
    None in records written before the field existed."""
    fleet: Annotated[list[WorkerLoads], msgspec.Meta(max_length=MAX_WORKERS)] = msgspec.field(
        default_factory=list
    )
    """Every live worker as the router saw it: (worker, in-flight requests, KV tokens), in
    the router's order. `loads` holds the policy's measure of the same workers; this holds
    both, so a replay can switch the load measure. Empty in older records."""
    prompt_tokens: Count | None = None
    """Prompt tokens of the request (what an assignment adds to a worker's KV load)."""
    outcome: DecisionOutcome = "assigned"
    """"assigned", or "expired": decided after the event's deadline, no worker assigned
    (`worker_id` is `NO_WORKER`, no loads, scores or band; readers count nothing against
    any worker). v2."""
    profile: RoutingProfile | None = None
    """The routing profile in force: the policy and every parameter, typed
    (`eldr.core.routing.profile`). v3; None in older records (see `params`)."""
    considered: Annotated[list[ConsideredWorker], msgspec.Meta(max_length=MAX_WORKERS)] = (
        msgspec.field(default_factory=list)
    )
    """What the decision's stages read of each candidate, in the router's order, where
    `fleet` and the partition do not say it: every candidate of a fleet-scale profile
    (whose decision reads no other worker: `fleet` is then empty) and the activity terms
    of the marginal-union scorer. A replay re-runs the stages on exactly these. v4."""
    live_workers: Count | None = None
    """Live workers when the decision was made, with `considered` and no `fleet`. v4."""
    fleet_totals: tuple[Count, Count] | None = None
    """(in-flight requests, KV tokens) summed over the live fleet, with `considered` and no
    `fleet` (a load ceiling compares a candidate with the fleet's mean). v4."""
    client_request_id: ClientRequestId | None = None
    """The client's own id for the request, copied from the PrefillDone (a label; the
    record is keyed by `request_id`, the gateway's id). v4."""
    v: Version = 4

    @property
    def assigned(self) -> bool:
        """Whether the record sends the request to `worker_id` (not an expired one)."""
        return self.outcome == "assigned"

    @property
    def workers_seen(self) -> list[str]:
        """The workers the decision read, in the router's order: its fleet, else (records
        before v4) its loads, else its candidates."""
        if self.fleet:
            return [w for w, _, _ in self.fleet]
        if self.loads:
            return [w for w, _ in self.loads]
        return [row[0] for row in self.considered]

    @property
    def routing_profile(self) -> ProfileBase:
        """The profile the decision was made with: `profile`, or for records before v3
        their `policy` and `params` mapped onto one (`profile_from_params`); ValueError
        for a policy or parameter this code does not know."""
        if self.profile is not None:
            return self.profile
        return profile_from_params(self.policy, self.params)

    def __post_init__(self) -> None:
        if self.profile is not None:
            require(
                self.policy == self.profile.name and not self.params,
                f"a decision with a profile names its policy ({self.profile.name!r}, not "
                f"{self.policy!r}) and has no untyped params",
            )
        if self.outcome == "expired":
            require(
                self.worker_id == NO_WORKER and not (self.fleet or self.loads or self.band),
                f"an expired decision names no worker ({NO_WORKER!r}) and no fleet",
            )
        else:
            require(
                self.worker_id != NO_WORKER,
                f"an assigned decision names a worker, not {NO_WORKER!r}",
            )
        # Also on construction (the Meta limits run on decode only): a router cannot build,
        # and so cannot commit, a decision that its readers would refuse.
        require(
            len(self.fleet) <= MAX_WORKERS
            and len(self.loads) <= MAX_WORKERS
            and len(self.band) <= MAX_WORKERS
            and len(self.considered) <= MAX_WORKERS,
            f"a decision names at most {MAX_WORKERS} workers, this one {len(self.fleet)} "
            f"(fleet), {len(self.loads)} (loads), {len(self.band)} (band), "
            f"{len(self.considered)} (considered)",
        )
        if self.considered and not self.fleet:
            require(
                self.live_workers is not None
                and self.live_workers >= len(self.considered)
                and self.fleet_totals is not None,
                "a decision that records candidates but no fleet records the live workers "
                "(at least as many as its candidates) and the fleet's load totals",
            )
        require(
            len(self.scores) <= MAX_SCORES and len(self.params) <= MAX_PARAMS,
            f"a decision records at most {MAX_SCORES} scores and {MAX_PARAMS} parameters",
        )


class _DecisionView(Message, frozen=True, kw_only=True, tag="decision"):
    """What every view of a `Decision` holds (see `VIEWS`): the request, its worker and the
    outcome, with the record's invariant between the two."""

    request_id: Ident
    worker_id: Token
    outcome: DecisionOutcome = "assigned"
    v: Version = 4

    def __post_init__(self) -> None:
        require(
            (self.worker_id == NO_WORKER) == (self.outcome == "expired"),
            f"an expired decision names no worker ({NO_WORKER!r}), an assigned one a worker",
        )

    @property
    def assigned(self) -> bool:
        return self.outcome == "assigned"


class DecisionAssignment(_DecisionView, frozen=True, kw_only=True, tag="decision"):
    """What a reader that only counts assignments needs of a `Decision`: a view, decoded
    from a Decision's bytes (`decode(data, DecisionAssignment)`) with every other field
    skipped unread. Never encoded or sent: the full record stays on the DECISIONS stream
    for replay. Router replicas read other replicas' decisions through it (the load and
    activity tables need the worker, the signature and the prompt length); a full
    decision with its fleet, loads, scores and band costs several times more to decode.

    Each field has the type of the `Decision` field of the same name (a unit test keeps
    them equal) and `v` is Decision's version, so a record the full type refuses (a newer
    schema) this view refuses too."""

    router_id: Ident
    model: Ident
    signature: SparseCounts | None
    prompt_tokens: Count | None = None


class DecisionRoute(_DecisionView, frozen=True, kw_only=True, tag="decision"):
    """The smallest view of a `Decision` (see `DecisionAssignment`): which worker a request
    went to. Decode adapters read every decision through it to learn which requests are
    coming to their instance."""


VIEWS: dict[type[Message], type[Message]] = {
    DecisionAssignment: Decision,
    DecisionRoute: Decision,
}
"""Views (decoded from the bytes of the message type they map to, never sent) and the
type whose records they read."""


DECISION_FIXED_BYTES = 32 << 10
"""Allowance for everything in a `Decision` besides its worker lists and signature: ids
(request, router, model, worker, policy; at most 1 KiB each in UTF-8), the fallback reason
and the routing profile (both written by the router itself, a few hundred bytes: the
largest profile encodes to under 120)."""


def decision_bytes_bound(max_workers: int, max_cells: int, max_scores: int) -> int:
    """The most bytes a `Decision` encodes to when it names at most `max_workers` workers
    (fleet, band, considered: a router writes `loads` only with none of the fleet),
    `max_scores` scores and a signature of at most `max_cells` cells: fleet entries 278
    bytes (a 256-character token and two integers), considered 305 (the same and three
    floats), band 259, scores 269, a signature cell 8 (uint32 index and count), plus
    `DECISION_FIXED_BYTES`. A router checks its limits against this at start so that
    every decision it can make fits the readers' `max_payload_bytes`."""
    per_worker = 278 + 305 + 259
    return DECISION_FIXED_BYTES + max_workers * per_worker + max_scores * 269 + max_cells * 8


class LoadReport(Message, frozen=True, tag="load_report"):
    """A decode worker's load, published periodically on `{ns}.load.{worker_id}`."""

    worker_id: Token
    incarnation: Ident
    """New per process start: a change resets the receiver's view (and `seq`)."""
    seq: U64
    """Per-incarnation sequence number, +1 per report."""
    ts_s: TimestampS
    running: Count
    """Requests decoding now."""
    waiting: Count
    """Requests admitted but not yet scheduled."""
    kv_tokens: Count
    """KV-cache tokens in use."""
    kv_capacity_tokens: Count
    admitted: Annotated[list[Ident], msgspec.Meta(max_length=MAX_ADMITTED)]
    """Request ids admitted since the previous report (lets routers retire their
    optimistic in-flight increments)."""
    draining: bool = False
    """True while shutting down: route nothing new here."""

    def __post_init__(self) -> None:
        require(self.worker_id != NO_WORKER, f"{NO_WORKER!r} is not a worker id")


# The wire keeps the older word: the tag "decode_profile", the subjects
# `{ns}.profiles.*`, the PROFILES stream, its metrics and ELDR_PROFILES_* settings are
# external names, and recorded logs and golden files must still decode.
class DecodeSummary(Message, frozen=True, tag="decode_profile"):
    """Decode-side expert counts of a finished request, on `{ns}.profiles.{worker_id}`."""

    request_id: Ident
    worker_id: Token
    ts_s: TimestampS
    """When decoding finished, Unix seconds."""
    tokens: Count
    """Decode tokens generated."""
    counts: SparseCounts
    """Decode expert counts [L, E] over all generated tokens."""
    tpot_s: DurationS | None = None
    """Mean time per output token, seconds, if measured."""


class RequestFinished(Message, frozen=True, kw_only=True, tag="request_finished"):
    """A request left a decode worker, as the gateway that proxied it saw it.

    Core publish on `{ns}.finished.{gateway_id}`, recorded by stream FINISHED. Every
    request the gateway sent to a decode worker ends in exactly one event with a final
    reason (stop, length, abort, error); a request moved to another worker before it
    started there adds one "moved" event per move. Routers drop the request from their
    load and activity tables, the trainer marks it finished; a decode summary is not
    needed for either.
    """

    request_id: Ident
    gateway_id: Token
    """The publishing gateway (the subject's last token)."""
    ts_s: TimestampS
    """When the gateway saw the end, Unix seconds."""
    reason: FinishReason
    worker_id: Token | None
    """The decode worker the request ran on (or left, for "moved"); None when the request
    never reached one (e.g. every decode attempt failed to connect)."""
    moved_to: Token | None = None
    """For "moved": the worker the request was sent to instead."""
    output_tokens: Count | None = None
    """Tokens the decode returned, when the response said (usage, or streamed chunks)."""
    decode_s: DurationS | None = None
    """From sending the request to the decode worker to the end of its response."""
    client_request_id: ClientRequestId | None = None
    """The client's own id for the request (a label; `request_id` is the gateway's). v2."""
    v: Version = 2

    def __post_init__(self) -> None:
        if self.reason == "moved":
            require(
                self.worker_id is not None and self.moved_to is not None,
                "a 'moved' RequestFinished names worker_id and moved_to",
            )
        else:
            require(self.moved_to is None, f"moved_to is set but the reason is {self.reason!r}")


class CaptureStatus(Message, frozen=True, kw_only=True, tag="capture_status"):
    """What an engine's ELDR capture plugin can do, on `{ns}.capture.{worker_id}` (core).

    Published when the plugin decides (at model load), whenever a state changes, and every
    `interval_s`. The gateway routes load-only at once for a prefill instance whose
    prefill capture is not "ok" (or that sends no status), instead of waiting for a
    decision that cannot come.
    """

    worker_id: Token
    """The engine's ELDR worker id (prefill worker, or decode worker as decisions name it)."""
    incarnation: Ident
    """New per engine process."""
    seq: U64
    """+1 per status of this incarnation."""
    ts_s: TimestampS
    interval_s: DurationS
    """The next status comes within this; receivers treat 3x as silence."""
    prefill_capture: CaptureState
    """Block summaries and PrefillDone for the prompts this engine computes."""
    decode_profiles: CaptureState
    """DecodeSummary for the requests this engine decodes."""
    reason: Text | None = None
    """Why a state is "failed" (or why it is "off"), in words."""
    model: Ident | None = None
    num_moe_layers: NumMoeLayers | None = None
    num_experts: NumExperts | None = None
    top_k: Positive | None = None
    vllm_version: Ident | None = None
    runner: Ident | None = None
    """The model runner class the plugin hooked (e.g. "CPUModelRunner")."""
    steps_rejected: Count = 0
    """Engine steps whose captured rows failed validation since the engine started."""
    kv_connector: Ident | None = None
    """The KV connector the instance runs (`kv_transfer_config.kv_connector`, e.g.
    "NixlConnector"); None when it runs none. Gateways refuse an instance whose connector
    they cannot drive. v2."""
    v: Version = 2


# --- partitions ---------------------------------------------------------------------------


class PartitionAnnouncement(Message, frozen=True, tag="partition_announcement"):
    """A new partition version is active; its blob is in the object store.

    Published on `{ns}.partition.active` (stream PARTITIONS); routers read the last one at
    start and hot-swap on each new one.
    """

    version: Version
    model: Ident
    object_name: Ident
    """Name of the `PartitionBlob` in bucket `{ns}-partitions`."""
    sha256: Sha256Hex
    """Hex SHA-256 of the blob's encoded bytes."""
    created_ts_s: TimestampS
    k: Positive
    """Number of clusters."""
    dim: Positive
    """Dimension of the centroids (after any projection)."""
    workers: WorkerList
    """Decode workers the partition assigns clusters to."""


class PartitionBlob(Message, frozen=True, kw_only=True, tag="partition_blob"):
    """Everything a router needs to score a signature against a partition version.

    v2 dropped v1's `prices` (per-worker score offsets, never set); decoding a v1 blob
    ignores it.
    """

    version: Version
    model: Ident
    transform: Ident
    """Signature transform, e.g. "counts_idf" or "raw" (`eldr.core.signature.signature`)."""
    num_moe_layers: NumMoeLayers
    num_experts: NumExperts
    idf: NdArray | None
    """float32 [L, E] IDF weights when the transform uses them."""
    layer_mask: NdArray
    """uint8 [L]: 1 for the MoE layers the signature keeps."""
    centroids: NdArray
    """float32 [M, d], unit length; M >= k when clusters have sub-centroids."""
    owners: Annotated[list[Count], msgspec.Meta(max_length=1 << 20)]
    """owners[m] is the index into `workers` of centroid m's worker."""
    workers: WorkerList
    metrics: Annotated[dict[Ident, FiniteFloat], msgspec.Meta(max_length=MAX_METRICS)]
    """Fit diagnostics (inertia, balance, iterations, ...)."""
    projection: NdArray | None = None
    """float32 [D, d]: when set, a signature (length D = kept layers x E) is centred by
    `projection_mean` and multiplied by this before scoring."""
    projection_mean: NdArray | None = None
    """float32 [D]."""
    v: Version = 2

    def __post_init__(self) -> None:
        n_layers, n_experts = self.num_moe_layers, self.num_experts
        require(
            self.layer_mask.dtype == "uint8" and self.layer_mask.shape == [n_layers],
            f"layer_mask must be uint8 [{n_layers}], got {self.layer_mask.dtype} "
            f"{self.layer_mask.shape}",
        )
        if self.idf is not None:
            require(
                self.idf.dtype == "float32" and self.idf.shape == [n_layers, n_experts],
                f"idf must be float32 [{n_layers}, {n_experts}], got {self.idf.dtype} "
                f"{self.idf.shape}",
            )
        require(
            self.centroids.dtype == "float32" and len(self.centroids.shape) == 2,
            f"centroids must be float32 [M, d], got {self.centroids.dtype} {self.centroids.shape}",
        )
        n_centroids, dim = self.centroids.shape
        require(
            len(self.owners) == n_centroids,
            f"{len(self.owners)} owners for {n_centroids} centroids",
        )
        require(
            all(o < len(self.workers) for o in self.owners),
            f"an owner index is >= the number of workers ({len(self.workers)})",
        )
        if self.projection is not None:
            require(
                self.projection.dtype == "float32"
                and len(self.projection.shape) == 2
                and self.projection.shape[1] == dim,
                f"projection must be float32 [D, {dim}], got {self.projection.shape}",
            )
            require(
                self.projection_mean is not None
                and self.projection_mean.dtype == "float32"
                and self.projection_mean.shape == self.projection.shape[:1],
                "projection_mean must be float32 [D] when projection is set",
            )


# --- control ------------------------------------------------------------------------------


class RouterControl(Message, frozen=True, tag="router_control"):
    """CLI -> every router replica: change the routing profile; all fields None = just
    report.

    `profile` (v2) replaces the replica's profile. The older fields switch policy and set
    parameters on the current profile instead (`profile_from_params` with the current
    one kept: parameters the new policy takes carry over); they cannot be combined with
    `profile`.
    """

    policy: Ident | None = None
    tau: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_ABS_FLOAT)] | None = None
    """Locality band width (cosine units), >= 0."""
    load_measure: Ident | None = None
    """"requests" or "kv_tokens"."""
    profile: RoutingProfile | None = None
    """The routing profile to route with from now on. v2."""
    v: Version = 2

    def __post_init__(self) -> None:
        require(
            self.profile is None
            or (self.policy is None and self.tau is None and self.load_measure is None),
            "a router control sets a profile or policy/tau/load_measure, not both",
        )


class RouterControlReply(Message, frozen=True, kw_only=True, tag="router_control_reply"):
    router_id: Ident
    policy: Ident
    params: Annotated[dict[AttrKey, ParamValue], msgspec.Meta(max_length=MAX_PARAMS)]
    partition_version: Version | None = None
    """Partition version the replica routes with (None: none loaded)."""
    live_workers: Count = 0
    """Decode workers in the replica's load table."""
    announced_version: Version | None = None
    """Newest partition version the replica has seen announced (None: none, or a replica
    older than v2). Differs from `partition_version` while that one is not loaded yet."""
    partition_error: Text | None = None
    """Why the announced version is not in use yet (its last load attempt's error), while
    it is not; the replica keeps retrying. v2 added both fields."""
    profile: RoutingProfile | None = None
    """The routing profile the replica routes with (`policy` and `params` name the same
    for older readers). v3."""
    v: Version = 3


class RefitRequest(Message, frozen=True, tag="refit_request"):
    """CLI -> trainer: fit and publish a new partition version now."""

    reason: Text
    k: Positive | None = None
    """Number of clusters; None = one per known decode worker."""


class RefitReply(Message, frozen=True, tag="refit_reply"):
    version: Version | None
    """The new version; None if no version was published."""
    status: Ident
    """e.g. "ok", "skipped", "error"."""
    message: Text


# --- simulated workers (development and tests; `eldr_services.simprefill/simdecode`) -----


class DecodeJob(Message, frozen=True, kw_only=True, tag="decode_job"):
    """Simulated gateway -> simulated decode worker: decode this request.

    Core request on `{ns}.sim.decode.{worker_id}`; the worker answers `DecodeJobAck` at once
    and decodes in (scaled) real time, replaying `decode_ids` step by step.
    """

    request_id: Ident
    worker_id: Token
    model: Ident
    prompt_tokens: Count
    decode_ids: NdArray
    """int16 [decode_tokens, moe_layers, top_k]: the experts each decode token routes to."""
    label: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)] = ""
    """Workload label (e.g. the trace's subject), for statistics."""
    done_to: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)] | None = None
    """Inbox that gets a `DecodeJobDone` when the request ends (the simulated end of the
    decode response, which a real gateway sees when the stream closes). v2."""
    v: Version = 2

    def __post_init__(self) -> None:
        require(
            self.decode_ids.dtype == "int16" and len(self.decode_ids.shape) == 3,
            f"decode_ids must be int16 [tokens, layers, top_k], got {self.decode_ids.dtype} "
            f"{self.decode_ids.shape}",
        )


class DecodeJobAck(Message, frozen=True, tag="decode_job_ack"):
    request_id: Ident
    accepted: bool
    reason: Text | None = None


class DecodeJobDone(Message, frozen=True, tag="decode_job_done"):
    """Simulated decode worker -> the job's `done_to`: the request's decode ended."""

    request_id: Ident
    worker_id: Token
    reason: Literal["length", "abort"]
    """"length": it decoded all its tokens; "abort": dropped unfinished (shutdown)."""
    output_tokens: Count


class SimStatsRequest(Message, frozen=True, tag="sim_stats_request"):
    """Ask every simulated decode worker for its statistics (`{ns}.sim.stats`)."""

    reset: bool = False
    """Clear the statistics after answering (start a new measurement window)."""


class SimStats(Message, frozen=True, tag="sim_stats"):
    """A simulated decode worker's statistics since its last reset."""

    worker_id: Token
    steps: Count
    """Decode steps run."""
    union_per_layer_sum: Annotated[float, msgspec.Meta(ge=0.0)]
    """Sum over steps of distinct experts per MoE layer (divide by `steps` for the mean)."""
    batch_sum: Count
    """Sum over steps of the batch size."""
    finished: Count
    """Requests finished."""
    tpot_s: NdArray
    """float32 [finished (at most the newest 65,536)]: TPOT of each finished request."""
    running: Count = 0
    waiting: Count = 0


# --- operations ---------------------------------------------------------------------------


class DeadLetter(Message, frozen=True, tag="dead_letter"):
    """A message the bus could not process, on `{ns}.dlq.{stream}` (stream DLQ)."""

    subject: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN * 2)]
    """Subject the message arrived on."""
    stream: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)] | None
    """Stream it came from; None for core messages."""
    error: Text
    received_ts_s: TimestampS
    payload: Annotated[bytes, msgspec.Meta(max_length=MAX_DEAD_LETTER_PAYLOAD_BYTES)]
    """The original payload, truncated to MAX_DEAD_LETTER_PAYLOAD_BYTES."""
    headers: Annotated[dict[str, Text], msgspec.Meta(max_length=MAX_HEADERS)]
    payload_size_bytes: Count = 0
    """Size of the original payload before truncation."""
    stream_seq: U64 | None = None
    """Sequence of the message in `stream`, when it came from a stream."""
    num_delivered: Count = 0
    """Deliveries of the message before it was dead-lettered (0 for core messages)."""


ALL_MESSAGE_TYPES: tuple[type[Message], ...] = (
    BlockSummaryBatch,
    PrefillDone,
    AssembleRequest,
    AssembleReply,
    Decision,
    LoadReport,
    DecodeSummary,
    RequestFinished,
    CaptureStatus,
    PartitionAnnouncement,
    PartitionBlob,
    RouterControl,
    RouterControlReply,
    RefitRequest,
    RefitReply,
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    SimStatsRequest,
    SimStats,
    DeadLetter,
)
"""Every top-level message type; the codec decodes against this tagged union."""
