"""`eldr bench-kmeans`: time the balanced K-means partition fit at production size.

The trainer refits one centroid per decode worker from recent request signatures; this
command measures how long that fit takes and what exact balance costs in inertia, on a
synthetic signature matrix (no real traces needed). The input is synthetic: a topic mixture
with Zipf-skewed topic popularity and per-layer Zipf-skewed expert popularity, rows
non-negative, sparse-ish and L2-normalised, like count x IDF signatures.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from eldr.core.partition.kmeans import KMeansResult, balanced_spherical_kmeans, spherical_kmeans
from eldr.progress import NO_PROGRESS, Progress

__all__ = ["print_report", "run_benchmark", "synthetic_signatures"]

log = logging.getLogger(__name__)

# Qwen3-30B-A3B has 128 routed experts per MoE layer; 6,144 = 48 layers x 128 experts.
EXPERTS_PER_LAYER = 128
_CHUNK_ROWS = 4096


def synthetic_signatures(
    n: int,
    dim: int,
    *,
    seed: int,
    num_topics: int = 96,
    mean_prompt_tokens: float = 200.0,
    top_k: int = 8,
    topic_concentration: float = 2.5,
) -> np.ndarray:
    """Deterministic synthetic signature matrix, float32 [n, dim], unit rows.

    Each request draws a main topic (Zipf popularity, so natural clusters are very
    unequal) and, with weight 0.3, a second one. A topic is a per-layer distribution over
    experts: a global Zipf popularity (random expert order per layer) times a log-normal
    topic preference (sigma `topic_concentration`; larger means each topic uses fewer
    experts, so rows are sparser and clusters more distinct). A row is the expected
    expert counts of a prompt of log-normal length times uniform noise, with counts below
    one half set to zero (rare experts of short prompts are absent, which makes rows
    sparse-ish: about 40% zeros at the defaults); then L2-normalised.
    """
    if n < 1 or dim < 1:
        raise ValueError(f"n and dim must be positive, got n={n}, dim={dim}")
    rng = np.random.default_rng(seed)
    if dim % EXPERTS_PER_LAYER == 0:
        layers, experts = dim // EXPERTS_PER_LAYER, EXPERTS_PER_LAYER
    else:
        layers, experts = 1, dim
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    popularity = np.stack([rng.permutation(1.0 / ranks) for _ in range(layers)])
    preference = np.exp(topic_concentration * rng.standard_normal((num_topics, layers, experts)))
    topics = popularity[None] * preference
    topics /= topics.sum(axis=2, keepdims=True)  # per layer: share of the top_k slots
    topics = topics.reshape(num_topics, dim).astype(np.float32)

    topic_weights = 1.0 / np.arange(1, num_topics + 1) ** 1.1
    topic_weights /= topic_weights.sum()
    main = rng.choice(num_topics, size=n, p=topic_weights)
    second = rng.integers(0, num_topics, size=n)
    tokens = rng.lognormal(math.log(mean_prompt_tokens), 0.8, size=n)

    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(n, start + _CHUNK_ROWS)
        rows = np.arange(stop - start)
        mix = np.zeros((stop - start, num_topics), dtype=np.float32)
        mix[rows, main[start:stop]] += 0.7
        mix[rows, second[start:stop]] += 0.3
        mix *= (tokens[start:stop] * top_k).astype(np.float32)[:, None]
        block = out[start:stop]
        np.matmul(mix, topics, out=block)
        block *= rng.random(block.shape, dtype=np.float32) * 2.0
        block[block < 0.5] = 0.0
        norms = np.linalg.norm(block, axis=1)
        # A prompt too short to clear the threshold anywhere keeps its main topic's profile.
        empty = norms == 0.0
        if empty.any():
            block[empty] = topics[main[start:stop][empty]]
            norms[empty] = np.linalg.norm(block[empty], axis=1)
        block /= norms[:, None]
    return out


def _size_stats(result: KMeansResult) -> tuple[int, int]:
    return int(result.sizes.max()), int(result.sizes.min())


def run_benchmark(
    n: int,
    dim: int,
    k: int,
    *,
    seed: int = 0,
    reduce_dim: int | None = 128,
    unconstrained: bool = False,
    max_iter: int = 50,
    progress: Progress = NO_PROGRESS,
) -> dict[str, Any]:
    """Generate the synthetic input, fit, and return the measurements as a dict.

    progress: one unit for the data, then one per K-means iteration (`max_iter` per fit,
    the rest at once when a fit converges early).
    """
    t0 = time.perf_counter()
    progress.describe("generating signatures")
    X = synthetic_signatures(n, dim, seed=seed)
    generate_s = time.perf_counter() - t0
    progress.advance()
    log.info("generated synthetic signatures n=%d dim=%d in %.1f s", n, dim, generate_s)

    def iteration(i: int) -> None:
        progress.advance()

    t0 = time.perf_counter()
    progress.describe("balanced fit")
    balanced = balanced_spherical_kmeans(
        X, k, seed=seed, max_iter=max_iter, reduce_dim=reduce_dim, on_iteration=iteration
    )
    fit_s = time.perf_counter() - t0
    progress.advance(max_iter - balanced.iterations)
    max_size, min_size = _size_stats(balanced)
    report: dict[str, Any] = {
        "input": "synthetic (topic mixture, Zipf topic and expert popularity); not real traces",
        "n": n,
        "dim": dim,
        "k": k,
        "seed": seed,
        "reduce_dim": balanced.reduce_dim_used,
        "generate_s": round(generate_s, 3),
        "fit_s": round(fit_s, 3),
        "capacity": balanced.capacity,
        "max_size": max_size,
        "min_size": min_size,
        "inertia": balanced.inertia,
        "mean_inertia": balanced.inertia / n,
        "iterations": balanced.iterations,
        "converged": balanced.converged,
    }
    if unconstrained:
        t0 = time.perf_counter()
        progress.describe("unconstrained fit")
        free = spherical_kmeans(
            X, k, seed=seed, max_iter=max_iter, reduce_dim=reduce_dim, on_iteration=iteration
        )
        report["unconstrained_fit_s"] = round(time.perf_counter() - t0, 3)
        progress.advance(max_iter - free.iterations)
        free_max, free_min = _size_stats(free)
        report["unconstrained_max_size"] = free_max
        report["unconstrained_min_size"] = free_min
        report["unconstrained_inertia"] = free.inertia
        report["unconstrained_iterations"] = free.iterations
        report["inertia_ratio"] = (
            balanced.inertia / free.inertia if free.inertia > 0 else float("nan")
        )
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"input: {report['input']}")
    print(
        f"N={report['n']} d={report['dim']} K={report['k']} seed={report['seed']} "
        f"reduce_dim={report['reduce_dim']}"
    )
    print(f"data generation: {report['generate_s']:.2f} s (not part of the fit)")
    print(
        f"balanced fit: {report['fit_s']:.2f} s wall, {report['iterations']} iterations, "
        f"converged={report['converged']}"
    )
    print(
        f"cluster sizes: max={report['max_size']} min={report['min_size']} "
        f"capacity={report['capacity']}"
    )
    print(f"inertia (sum of 1 - cos): {report['inertia']:.2f} ({report['mean_inertia']:.4f}/row)")
    if "unconstrained_inertia" in report:
        print(
            f"unconstrained fit: {report['unconstrained_fit_s']:.2f} s, sizes "
            f"max={report['unconstrained_max_size']} min={report['unconstrained_min_size']}, "
            f"inertia {report['unconstrained_inertia']:.2f}"
        )
        print(f"inertia ratio balanced/unconstrained: {report['inertia_ratio']:.3f}")
