"""`eldr.vllm.capture`: engine-step rows -> block summaries and PrefillDone (no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.signature.blocks import sum_summaries, summarize_blocks
from eldr.core.workload.trace import ModelGeometry
from eldr.roles.prefill import LocalSummary
from eldr.vllm.capture import (
    CaptureConfig,
    CaptureState,
    StepResult,
)
from eldr.vllm.plugin import base_request_id, vllm_version_supported
from eldr.wire import PrefillDone
from eldr.wire.base import MAX_BLOCKS_PER_BATCH

L, E, K = 3, 8, 2
GEOMETRY = ModelGeometry.of_moe(L, E, K)


def state(block_size: int = 4, local_summary_bytes: int | None = None) -> CaptureState:
    config = CaptureConfig("prefill-0", "m", block_size, GEOMETRY)
    if local_summary_bytes is not None:
        config = CaptureConfig(
            "prefill-0", "m", block_size, GEOMETRY, local_summary_bytes=local_summary_bytes
        )
    return CaptureState(config)


def prompt(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, size=n).astype(np.uint32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)
    return tokens, ids.astype(np.int16)


def run_one_step(s: CaptureState, rid: str, ids: np.ndarray, start: int) -> StepResult:
    n = ids.shape[0]
    positions = np.arange(start, n)
    return s.on_step([rid], [n - start], positions, ids[start:], 1.0, 100.0)


def published(result: StepResult) -> list[PrefillDone]:
    """What the publisher's thread does with a step: build its block batches (which keeps
    them in the local store), then its events."""
    return result.done


def signature(done: PrefillDone, reference_blocks: list[np.ndarray]) -> np.ndarray:
    """What the router assembles: the event's whole `signature`, or the cached blocks'
    counts plus `computed`."""
    if done.signature is not None:
        assert done.computed is None
        return done.signature.to_dense(np.int32)
    assert done.computed is not None
    cached = reference_blocks[: done.cached_prefix_blocks]
    return sum_summaries(cached, (L, E)) + done.computed.to_dense(np.int32)


def test_one_step_prefill_yields_every_full_block_and_the_done_event() -> None:
    tokens, ids = prompt(11)
    s = state()
    s.add_request("e1", tokens, 0, 0.5, request_id="r1", reply_to="inbox.1", max_tokens=7)
    result = run_one_step(s, "e1", ids, 0)
    full, partial = summarize_blocks(tokens, ids, 4, E)
    assert [b.block_hash for b in result.batches[0].blocks] == [b.block_hash for b in full]
    for got, want in zip(result.batches[0].blocks, full, strict=True):
        np.testing.assert_array_equal(got.counts.to_dense(np.uint16), want.counts)
        assert got.parent_hash == want.parent_hash
    (done,) = result.done
    assert (done.request_id, done.reply_to, done.max_tokens) == ("r1", "inbox.1", 7)
    assert done.block_hashes == [b.block_hash for b in full]
    assert done.cached_prefix_blocks == 0
    assert partial is not None
    assert done.partial is not None
    np.testing.assert_array_equal(done.partial.to_dense(np.uint16), partial.counts)
    assert done.prefill_s == pytest.approx(0.5)
    assert len(s) == 0


def test_a_resumed_request_scheduled_as_new_makes_no_second_event() -> None:
    """Model Runner V2 re-sends a preempted request in full, as a new one (vLLM 0.34's
    only path; 0.32's V2 already did): its prompt rows come again, its event does not."""
    tokens, ids = prompt(11)
    s = state()
    s.add_request("e1", tokens, 0, 0.5, request_id="r1")
    (done,) = run_one_step(s, "e1", ids, 0).done
    assert done.request_id == "r1"
    assert s.add_request("e1", tokens, 0, 2.0, request_id="r1") is None  # resumed
    assert s.resumed == 1
    assert run_one_step(s, "e1", ids, 0).done == []
    # Preempted halfway through its prefill: the capture so far stays.
    s.add_request("e2", tokens, 0, 0.5, request_id="r2")
    s.on_step(["e2"], [4], np.arange(4), ids[:4], 1.0, 100.0)
    assert s.add_request("e2", tokens, 0, 2.0, request_id="r2") is None
    (done,) = run_one_step(s, "e2", ids, 0).done  # recomputed from 0, as the engine does
    assert done.request_id == "r2"
    assert done.prefill_s == pytest.approx(0.5)
    # Once the engine finished it, the id is free again.
    s.drop("e1")
    assert s.add_request("e1", tokens, 0, 3.0, request_id="r1") is not None


def test_prefix_hit_leaves_cached_blocks_to_the_signature_cache() -> None:
    tokens, ids = prompt(14)
    full, partial = summarize_blocks(tokens, ids, 4, E)
    s = state()
    s.add_request("e1", tokens, 8, 0.0)
    result = run_one_step(s, "e1", ids, 8)
    assert [b.block_hash for b in result.batches[0].blocks] == [full[2].block_hash]
    (done,) = result.done
    assert done.cached_prefix_blocks == 2
    whole = sum_summaries([*full, *([partial] if partial else [])], (L, E))
    np.testing.assert_array_equal(signature(done, [b.counts for b in full]), whole)


def test_ragged_cache_hit_counts_the_straddled_block_once() -> None:
    tokens, ids = prompt(14)
    full, partial = summarize_blocks(tokens, ids, 4, E)
    s = state()
    s.add_request("e1", tokens, 6, 0.0)  # the hit ends inside block 1
    result = run_one_step(s, "e1", ids, 6)
    (done,) = result.done
    assert done.cached_prefix_blocks == 2
    assert "eldr_capture" not in done.attrs
    whole = sum_summaries([*full, *([partial] if partial else [])], (L, E))
    np.testing.assert_array_equal(signature(done, [b.counts for b in full]), whole)


def test_cache_hit_inside_the_partial_block_is_flagged_inexact() -> None:
    tokens, ids = prompt(10)
    s = state()
    s.add_request("e1", tokens, 9, 0.0)
    (done,) = run_one_step(s, "e1", ids, 9).done
    assert done.attrs["eldr_capture"] == "inexact"
    assert s.inexact == 1


def test_whole_prompt_cached_is_not_tracked() -> None:
    tokens, _ = prompt(8)
    s = state()
    assert s.add_request("e1", tokens, 8, 0.0) is None
    assert len(s) == 0


def test_rows_past_the_prompt_and_padding_are_ignored() -> None:
    tokens, ids = prompt(8)
    s = state()
    s.add_request("e1", tokens, 0, 0.0)
    padded = np.concatenate([ids, np.zeros((3, L, K), np.int16)])
    positions = np.arange(11)  # 8 prompt positions, then decode / padding rows
    result = s.on_step(["e1", "other"], [8, 2], positions, padded, 1.0, 1.0)
    (done,) = result.done
    np.testing.assert_array_equal(
        done.computed.to_dense(np.int32) if done.computed else None,
        sum_summaries(summarize_blocks(tokens, ids, 4, E)[0], (L, E)),
    )


def test_a_block_computed_twice_in_one_step_is_published_once() -> None:
    tokens, ids = prompt(8)
    s = state()
    s.add_request("e1", tokens, 0, 0.0)
    s.add_request("e2", tokens, 0, 0.0)
    both = np.concatenate([ids, ids])
    positions = np.concatenate([np.arange(8), np.arange(8)])
    result = s.on_step(["e1", "e2"], [8, 8], positions, both, 1.0, 1.0)
    assert len(result.batches[0].blocks) == 2
    assert len(result.done) == 2


def test_batches_split_at_the_wire_limit_with_consecutive_seq() -> None:
    n = (MAX_BLOCKS_PER_BATCH + 3) * 2
    tokens, ids = prompt(n)
    s = state(block_size=2)
    s.add_request("e1", tokens, 0, 0.0)
    result = run_one_step(s, "e1", ids, 0)
    assert [len(b.blocks) for b in result.batches] == [MAX_BLOCKS_PER_BATCH, 3]
    assert [b.seq for b in result.batches] == [0, 1]


def test_step_with_too_few_rows_is_rejected() -> None:
    tokens, ids = prompt(8)
    s = state()
    s.add_request("e1", tokens, 0, 0.0)
    with pytest.raises(ValueError, match="scheduled tokens"):
        s.on_step(["e1"], [8], np.arange(4), ids[:4], 1.0, 1.0)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    cached_blocks=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    chunk=st.integers(1, 17),
    seed=st.integers(0, 1000),
)
def test_chunked_interleaved_prefill_assembles_the_exact_signature(
    lengths: list[int], cached_blocks: list[int], chunk: int, seed: int
) -> None:
    """Whatever the chunking, interleaving and prefix hits, cached blocks + computed counts
    equal the counts of the whole prompt, and every block is summarised exactly."""
    bs = 4
    s = state(bs)
    prompts = {}
    for i, n in enumerate(lengths):
        tokens, ids = prompt(n, seed + i)
        hit = min(cached_blocks[i] * bs, (n - 1) // bs * bs)
        s.add_request(f"e{i}", tokens, hit, 0.0, request_id=f"r{i}")
        prompts[f"e{i}"] = (tokens, ids, hit)
    progress = {rid: hit for rid, (_, _, hit) in prompts.items()}
    rng = np.random.default_rng(seed)
    blocks: dict[int, np.ndarray] = {}
    done: dict[str, PrefillDone] = {}
    while any(progress[r] < prompts[r][0].shape[0] for r in progress):
        order = [r for r in rng.permutation(sorted(progress)) if progress[r] < len(prompts[r][0])]
        rows, positions, counts = [], [], []
        for r in order:
            lo = progress[r]
            hi = min(lo + chunk, len(prompts[r][0]))
            rows.append(prompts[r][1][lo:hi])
            positions.append(np.arange(lo, hi))
            counts.append(hi - lo)
            progress[r] = hi
        result = s.on_step(order, counts, np.concatenate(positions), np.concatenate(rows), 1, 1)
        for batch in result.batches:
            for b in batch.blocks:
                blocks[b.block_hash] = b.counts.to_dense(np.uint16)
        done.update({d.request_id: d for d in result.done})
    assert len(done) == len(lengths)
    for i, (tokens, ids, _) in enumerate(prompts.values()):
        full, partial = summarize_blocks(tokens, ids, bs, E)
        event = done[f"r{i}"]
        for b in full[event.cached_prefix_blocks :]:
            np.testing.assert_array_equal(blocks[b.block_hash], b.counts)
        whole = sum_summaries([*full, *([partial] if partial else [])], (L, E))
        np.testing.assert_array_equal(signature(event, [b.counts for b in full]), whole)


@pytest.mark.parametrize(
    ("engine_id", "client_id"),
    [
        ("cmpl-abc-0-1a2b3c4d", "abc"),
        ("chatcmpl-my-req-1a2b3c4d", "my-req"),
        ("cmpl-eldr-12ab-3-deadbeef", "eldr-12ab"),
        ("plain", "plain"),
    ],
)
def test_the_base_request_id_is_recovered_from_vllm_ids(engine_id: str, client_id: str) -> None:
    assert base_request_id(engine_id) == client_id


def test_block_hashes_are_keyed_with_the_deployment_key_and_the_deadline_travels() -> None:
    from eldr.core.signature.blocks import hash_chain, hash_key_from_secret

    key = hash_key_from_secret(b"deployment")
    s = CaptureState(CaptureConfig("prefill-0", "m", 4, GEOMETRY, hash_key=key))
    tokens, ids = prompt(10)
    s.add_request("e1", tokens, 0, 0.0, request_id="r1", decision_budget_s=0.25)
    (done,) = run_one_step(s, "e1", ids, 0).done
    assert done.block_hashes == hash_chain(tokens, 4, key=key)
    assert done.block_hashes != hash_chain(tokens, 4)
    assert done.deadline_s == pytest.approx(100.0 + 0.25)  # the step's wall clock + budget


# --- the local summary store (issue 14 item 1: local first, the service for misses) ------


def whole_counts(tokens: np.ndarray, ids: np.ndarray, bs: int = 4) -> np.ndarray:
    full, partial = summarize_blocks(tokens, ids, bs, E)
    return sum_summaries([*full, *([partial] if partial else [])], (L, E))


def shared_prefix(n: int, prefix: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A prompt of `n` tokens whose first `prefix` tokens (and their routing) are those of
    `prompt(n, 0)`."""
    tokens, ids = prompt(n, seed)
    base_tokens, base_ids = prompt(n, 0)
    tokens[:prefix], ids[:prefix] = base_tokens[:prefix], base_ids[:prefix]
    return tokens, ids


def test_a_prefix_hit_on_blocks_computed_here_carries_the_whole_signature() -> None:
    s = state()
    tokens, ids = prompt(14)
    s.add_request("e1", tokens, 0, 0.0, request_id="r1")
    (first,) = run_one_step(s, "e1", ids, 0).done
    assert (first.signature, first.cached_prefix_blocks) == (None, 0)  # nothing cached
    assert len(s.producer.local or ()) == 3
    hit_tokens, hit_ids = shared_prefix(15, 12, seed=5)
    s.add_request("e2", hit_tokens, 12, 0.0, request_id="r2")  # 3 cached blocks
    (done,) = run_one_step(s, "e2", hit_ids, 12).done
    assert done.cached_prefix_blocks == 3
    assert done.computed is None
    assert done.signature is not None
    assert done.signature_source == "event"
    np.testing.assert_array_equal(
        done.signature.to_dense(np.int32), whole_counts(hit_tokens, hit_ids)
    )
    assert (s.producer.local_hits, s.producer.local_misses) == (1, 0)


def test_the_engines_step_leaves_the_store_to_the_publisher() -> None:
    """The engine's thread only counts: the step's blocks enter the store when the
    publisher builds their messages, and a hit is looked up when it builds the event."""
    s = state()
    tokens, ids = prompt(14)
    s.add_request("e1", tokens, 0, 0.0, request_id="r1")
    result = run_one_step(s, "e1", ids, 0)
    assert len(s.producer.local or ()) == 0
    published(result)
    assert len(s.producer.local or ()) == 3
    hit_tokens, hit_ids = shared_prefix(15, 12, seed=5)
    s.add_request("e2", hit_tokens, 12, 0.0, request_id="r2")
    hit = run_one_step(s, "e2", hit_ids, 12)
    assert (s.producer.local_hits, s.producer.local_misses) == (0, 0)
    (done,) = hit.done
    assert done.signature is not None
    assert (s.producer.local_hits, s.producer.local_misses) == (1, 0)


def test_a_hit_on_a_block_the_store_evicted_falls_back_to_the_service() -> None:
    entry = LocalSummary.of(np.ones((L, E), np.uint16)).nbytes  # dense: every block's size
    s = state(local_summary_bytes=2 * entry)  # two blocks
    tokens, ids = prompt(12)
    s.add_request("e1", tokens, 0, 0.0)
    published(run_one_step(s, "e1", ids, 0))
    assert s.producer.local is not None
    assert len(s.producer.local) == 2
    assert s.producer.local.evictions == 1
    assert s.producer.local.bytes_used <= 2 * entry
    hit_tokens, hit_ids = shared_prefix(14, 8, seed=3)
    s.add_request("e2", hit_tokens, 8, 0.0)  # blocks 0 (evicted) and 1 (held)
    (done,) = run_one_step(s, "e2", hit_ids, 8).done
    assert done.signature is None
    assert done.computed is not None
    assert done.signature_source == "service"
    full = [b.counts for b in summarize_blocks(hit_tokens, hit_ids, 4, E)[0]]
    np.testing.assert_array_equal(signature(done, full), whole_counts(hit_tokens, hit_ids))
    assert (s.producer.local_hits, s.producer.local_misses) == (0, 1)


def test_blocks_loaded_from_elsewhere_fall_back_even_when_some_are_held() -> None:
    s = state()
    tokens, ids = prompt(8)
    s.add_request("e1", tokens, 0, 0.0)
    published(run_one_step(s, "e1", ids, 0))  # blocks 0 and 1 computed here
    hit_tokens, hit_ids = shared_prefix(14, 8, seed=4)
    # Blocks 0-2 cached: 0 and 1 computed here, 2 loaded by a connector from elsewhere.
    s.add_request("e2", hit_tokens, 12, 0.0)
    (done,) = run_one_step(s, "e2", hit_ids, 12).done
    assert done.cached_prefix_blocks == 3
    assert done.signature is None
    full = [b.counts for b in summarize_blocks(hit_tokens, hit_ids, 4, E)[0]]
    np.testing.assert_array_equal(signature(done, full), whole_counts(hit_tokens, hit_ids))
    assert (s.producer.local_hits, s.producer.local_misses) == (0, 1)


def test_no_budget_no_store_every_hit_asks_the_service() -> None:
    s = state(local_summary_bytes=0)
    assert s.producer.local is None
    tokens, ids = prompt(8)
    s.add_request("e1", tokens, 0, 0.0)
    published(run_one_step(s, "e1", ids, 0))
    s.add_request("e2", tokens, 4, 0.0)
    (done,) = run_one_step(s, "e2", ids, 4).done
    assert done.signature is None
    assert done.computed is not None
    assert (s.producer.local_hits, s.producer.local_misses) == (0, 1)


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.4", True),
        ("0.33.0", True),
        ("0.33.1+cpu", True),
        ("0.33.0rc1", True),
        ("0.31.9", False),
        ("0.34.0", True),
        ("0.34.2+cu130", True),
        ("0.35.0", False),
        ("1.0.0", False),
        ("?", False),
    ],
)
def test_the_plugin_supports_a_version_range(version: str, supported: bool) -> None:
    assert vllm_version_supported(version) is supported
