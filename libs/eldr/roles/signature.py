"""Signature assembly: where a prefilled request's expert counts come from.

The one place that acts on where the event says its counts are (`PrefillDone.signature_source`):
the event's own signature (its prefill worker held a summary of every block it took from its
prefix cache), what the prefill computed (no prefix hit: that is all of it), the partial block
of a prompt shorter than one block, or the signature service's sum over the blocks the event
names (the prefix-cache hits plus `computed`, or every block plus `partial` from a producer
that sends neither). The router service calls it for every PrefillDone.

The service call is injected (`Fetch`: an `AssembleRequest` in, the reply or why there is
none out), so the role does no I/O: the router passes its bus request, tests a function.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from eldr.wire import AssembleReply, AssembleRequest, PrefillDone, SparseCounts
from eldr.wire.messages import SignatureSource

log = logging.getLogger(__name__)

FetchFailure = Literal["signature_timeout", "signature_unavailable", "signature_error"]
"""Why the signature service gave no reply: none in time, no responder, an error (or a
reply the caller could not read)."""
Fetch = Callable[[AssembleRequest], Awaitable[AssembleReply | FetchFailure]]
"""The signature service's assembly call (the router: a bus request)."""
RefuseGeometry = Callable[[PrefillDone], str | None]
"""Why the event's geometry is not the caller's to use (None: it is); the caller counts and
logs a refusal."""


@dataclass(frozen=True)
class Assembled:
    """A request's prefill counts and where they came from."""

    counts: np.ndarray | None
    """[L, E], or None (the request is routed load-only)."""
    missing_blocks: int
    """Blocks whose counts the signature service did not have."""
    error: str | None
    """Why `counts` is None (one of the routing core's fallback reasons)."""
    source: SignatureSource
    """Where the counts came from ("none" where there are none without asking the service)."""
    fetched: bool = False
    """Whether the signature service was asked."""

    @property
    def fetch_outcome(self) -> str:
        """What the service's answer gave: "complete", "partial", or why it gave nothing
        ("timeout", "unavailable", "error", "no_signature")."""
        if self.error is None:
            return "complete" if self.missing_blocks == 0 else "partial"
        return self.error.removeprefix("signature_")


def _none(error: str, missing_blocks: int = 0) -> Assembled:
    return Assembled(None, missing_blocks, error, "none")


async def assemble(
    msg: PrefillDone,
    *,
    fetch: Fetch,
    may_fetch: bool,
    wait_ms: int,
    refuse_geometry: RefuseGeometry,
) -> Assembled:
    """The request's prefill counts: the whole signature the event carries, or what the
    prefill computed plus, from the signature service (`fetch`, only where `may_fetch`),
    its prefix-cache hits (`wait_ms`: how long the service waits for blocks in flight)."""
    if msg.capture == "unavailable":
        # The prefill could not capture (the gateway said so): route load-only now.
        return _none("no_capture")
    if refuse_geometry(msg) is not None:
        # Geometry from the caller's configuration, not from the message: nothing of this
        # shape is allocated (a 329-byte event declaring 256 x 65,536 took every router to
        # over 1 GiB); the request is decided load-only.
        return _none("geometry_mismatch")
    source = msg.signature_source
    if source == "event":
        # Local first: the prefill worker summed its own summaries of the cached blocks
        # (the wire checked the shape against the geometry checked above).
        assert msg.signature is not None
        return Assembled(msg.signature.to_dense(np.uint32), 0, None, "event")
    if source == "computed":
        assert msg.computed is not None  # and nothing came from a prefix cache
        return Assembled(msg.computed.to_dense(np.uint32), 0, None, "computed")
    if source == "partial_only":
        # A prompt shorter than one block: its partial block is the whole signature.
        assert msg.partial is not None
        return Assembled(msg.partial.to_dense(np.uint32), 0, None, "partial_only")
    if source == "none":
        return _none("empty_signature")
    # "service": the prefix-cache hits, to add to what the prefill computed; or, from a
    # producer that sent neither, every block and the partial one.
    computed = None if msg.computed is None else msg.computed.to_dense(np.uint32)
    blocks = msg.block_hashes if computed is None else msg.block_hashes[: msg.cached_prefix_blocks]
    if not may_fetch:
        return _none("no_signature", len(blocks))
    got = await _fetch(msg, blocks, msg.partial if computed is None else None, fetch, wait_ms)
    if computed is None or got.counts is None:
        return got
    return Assembled(got.counts + computed, got.missing_blocks, None, "service", True)


async def _fetch(
    msg: PrefillDone,
    block_hashes: list[int],
    partial: SparseCounts | None,
    fetch: Fetch,
    wait_ms: int,
) -> Assembled:
    """Sum of `block_hashes` (+ `partial`) from the signature service."""
    reply = await fetch(
        AssembleRequest(
            request_id=msg.request_id,
            model=msg.model,
            block_hashes=block_hashes,
            partial=partial,
            wait_ms=wait_ms,
            prefill_worker=msg.prefill_worker,
        )
    )
    if isinstance(reply, str):
        return Assembled(None, len(block_hashes), reply, "service", True)
    missing = reply.blocks_total - reply.blocks_found
    expected = [msg.num_moe_layers, msg.num_experts]
    if reply.counts is None:
        return Assembled(None, missing, "no_signature", "service", True)
    if reply.counts.shape != expected:
        log.warning(
            "signature for %s has shape %s, the request %s",
            msg.request_id,
            reply.counts.shape,
            expected,
        )
        return Assembled(None, missing, "signature_error", "service", True)
    return Assembled(reply.counts.to_numpy(), missing, None, "service", True)


def recorded_signature(msg: PrefillDone, counts: np.ndarray | None) -> SparseCounts | None:
    """The decision's record of `counts`: the event's own sparse counts when they are the
    whole of it (the signature in the event, or what the prefill computed with no prefix
    hit: re-encoding them costs ~15 us a decision), else `counts` encoded."""
    if counts is None:
        return None
    if msg.signature is not None:
        return msg.signature
    if msg.computed is not None and msg.cached_prefix_blocks == 0:
        return msg.computed
    return SparseCounts.from_dense(counts)
