"""`eldr bench-decide`: the router's in-process decision time, per policy.

Times `RouterCore.decide`, the call the router service makes for every PrefillDone once
the request's counts are known, on the state a busy router holds: `workers` decode workers
reporting load, each with about `in_flight` requests counted in the activity table. Between
two timed decisions the bench does, untimed, what the router does between two decisions:
the decision's assignment is noted in the load and activity tables, the oldest request in
flight finishes (so the fleet keeps its size), and every worker reports its load every
`report_every_s` of the simulated clock (one decision per `1 / rate` seconds). That upkeep
is timed separately (`upkeep_*`): it is CPU the router spends per decision too.

Requests come from a trace directory (`--traces`) or the pipeline benchmark's synthetic
set (24 MoE layers x 128 experts, top-1), as the router receives them: dense uint32 counts
[L, E]. The "eldr" row fits a partition on the same requests first (its scoring is part of
its decision). `decisions_sha256` digests the chosen workers in order: two runs with the
same inputs and seed route identically when their digests agree.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eldr.core.partition.partition import Partition, fit_partition
from eldr.core.routing.decide import RouterCore, RouteRequest
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import DEFAULT_PROFILE, PAPER_PROFILE, profile_type
from eldr.core.workload.trace import TraceSet, counts_matrix

MODEL = "bench"

DEFAULT_POLICIES = ("jsq", PAPER_PROFILE.name, DEFAULT_PROFILE.name)


@dataclass(frozen=True)
class DecideBenchConfig:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    workers: int = 16
    in_flight: int = 8
    """Requests in flight per worker (activity entries and reported load)."""
    decisions: int = 5000
    """Timed decisions per policy (after `warmup`)."""
    warmup: int = 500
    rate_per_s: float = 1000.0
    """Simulated decisions per second (how often load reports come between decisions)."""
    report_every_s: float = 0.1
    seed: int = 0


@dataclass(frozen=True)
class _Input:
    counts: list[np.ndarray]
    prompt_tokens: list[int]
    partition: Partition | None


def _prepare(traces: TraceSet, config: DecideBenchConfig, workers: Sequence[str]) -> _Input:
    geometry = traces.geometry
    prefill = counts_matrix(traces.traces, geometry, "prefill")
    shape = (geometry.num_moe_layers, geometry.num_experts)
    counts = [row.astype(np.uint32).reshape(shape) for row in prefill]
    partition = None
    if any(profile_type(p).uses_signature for p in config.policies):
        decode = counts_matrix(traces.traces, geometry, "decode")
        partition, _ = fit_partition(
            prefill, decode, geometry, list(workers), version=1, model=MODEL, seed=config.seed
        )
    return _Input(counts, [t.prompt_tokens for t in traces.traces], partition)


def _percentiles_us(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    return {
        "p50_us": round(float(np.percentile(us, 50)), 1),
        "p99_us": round(float(np.percentile(us, 99)), 1),
        "mean_us": round(float(us.mean()), 1),
    }


def bench_policy(policy: str, data: _Input, config: DecideBenchConfig) -> dict[str, Any]:
    """Decide `warmup + decisions` requests with `policy`; per-decision times."""
    workers = [f"decode-{i:02d}" for i in range(config.workers)]
    table = LoadTable(stale_after_s=1e9, pending_ttl_s=1e9)
    core = RouterCore(profile_type(policy)(), table, np.random.default_rng(config.seed))
    if data.partition is not None:
        core.set_partition(data.partition)
    rng = np.random.default_rng(config.seed + 1)
    n_req = len(data.counts)
    seq = dict.fromkeys(workers, 0)
    running: dict[str, set[str]] = {w: set() for w in workers}
    pending: dict[str, list[str]] = {w: [] for w in workers}
    fifo: deque[tuple[str, str]] = deque()
    now = 0.0

    def report(w: str) -> None:
        seq[w] += 1
        admitted = tuple(pending[w])
        running[w].update(admitted)
        pending[w].clear()
        table.on_report(Report(w, "i0", seq[w], len(running[w]), 0, 0, 1 << 20, admitted), now)

    def assign(w: str, rid: str, i: int) -> None:
        table.on_assignment(w, rid, data.prompt_tokens[i], now)
        core.note_assignment(w, rid, data.counts[i], data.prompt_tokens[i], now)
        pending[w].append(rid)
        fifo.append((rid, w))
        while len(fifo) > config.workers * config.in_flight:
            old, ow = fifo.popleft()
            core.note_finished(old, now)
            running[ow].discard(old)
            if old in pending[ow]:
                pending[ow].remove(old)

    for w in workers:
        report(w)
    for k in range(config.workers * config.in_flight):
        i = int(rng.integers(n_req))
        assign(workers[k % config.workers], f"pre{k}", i)
    for w in workers:
        report(w)

    total = config.warmup + config.decisions
    order = rng.integers(n_req, size=total)
    requests = [
        RouteRequest(f"r{k}", MODEL, data.prompt_tokens[i], counts=data.counts[i])
        for k, i in enumerate(order.tolist())
    ]
    step_s = 1.0 / config.rate_per_s
    per_report = max(1, round(config.report_every_s / step_s / config.workers))
    decide_ns = np.empty(total, dtype=np.int64)
    upkeep_ns = np.empty(total, dtype=np.int64)
    chosen = hashlib.sha256()
    clock = time.perf_counter_ns
    gc.collect()
    gc.freeze()  # as the services do after start-up (eldr.runtime)
    try:
        for k, req in enumerate(requests):
            now += step_s
            t0 = clock()
            outcome = core.decide(req, now)
            t1 = clock()
            assign(outcome.worker_id, req.request_id, int(order[k]))
            if k % per_report == 0:
                report(workers[(k // per_report) % config.workers])
            t2 = clock()
            decide_ns[k] = t1 - t0
            upkeep_ns[k] = t2 - t1
            chosen.update(outcome.worker_id.encode())
            chosen.update(b"\n")
    finally:
        gc.unfreeze()
    timed = slice(config.warmup, total)
    return {
        "policy": policy,
        "decide": _percentiles_us(decide_ns[timed]),
        "upkeep": _percentiles_us(upkeep_ns[timed]),
        "decisions": config.decisions,
        "decisions_sha256": chosen.hexdigest(),
    }


def run(traces: TraceSet, config: DecideBenchConfig) -> dict[str, Any]:
    workers = [f"decode-{i:02d}" for i in range(config.workers)]
    data = _prepare(traces, config, workers)
    cells = np.array([(c > 0).sum() for c in data.counts])
    geometry = traces.geometry
    return {
        "input": {
            "source": traces.source,
            "synthetic": traces.synthetic,
            "requests": len(traces),
            "geometry": f"{geometry.num_moe_layers} MoE layers x {geometry.num_experts} "
            f"experts, top-{geometry.top_k}",
            "nonzero_cells_p50": float(np.percentile(cells, 50)),
            "nonzero_cells_max": int(cells.max()),
            "workers": config.workers,
            "in_flight_per_worker": config.in_flight,
            "decisions": config.decisions,
            "rate_per_s": config.rate_per_s,
        },
        "results": [bench_policy(p, data, config) for p in config.policies],
    }


def format_table(result: dict[str, Any]) -> str:
    inp = result["input"]
    kind = "SYNTHETIC" if inp["synthetic"] else "real traces"
    lines = [
        f"input: {inp['source']} ({kind}), {inp['requests']} requests, {inp['geometry']}, "
        f"non-zero cells per request P50 {inp['nonzero_cells_p50']:g} max "
        f"{inp['nonzero_cells_max']}; {inp['workers']} workers x {inp['in_flight_per_worker']} "
        f"in flight, {inp['decisions']} decisions",
        f"{'policy':<14} {'decide P50 us':>13} {'P99 us':>8} {'mean us':>8} "
        f"{'upkeep P50 us':>13} {'mean us':>8}  decisions sha256",
    ]
    for r in result["results"]:
        d, u = r["decide"], r["upkeep"]
        lines.append(
            f"{r['policy']:<14} {d['p50_us']:>13.1f} {d['p99_us']:>8.1f} {d['mean_us']:>8.1f} "
            f"{u['p50_us']:>13.1f} {u['mean_us']:>8.1f}  {r['decisions_sha256'][:16]}"
        )
    lines.append(
        "decide: RouterCore.decide; upkeep: noting the assignment, one finish and the "
        "load reports between two decisions"
    )
    return "\n".join(lines)
