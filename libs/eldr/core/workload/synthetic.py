"""Synthetic MoE routing workloads, for the demo and for tests where real traces are absent.

Every TraceSet produced here has `synthetic=True`; reports built on it must say so.

The generative model ("world"), drawn once per workload from a `numpy.random.Generator`:

- Expert popularity: per MoE layer a Zipf law over a random permutation of the experts
  (`popularity_skew` is the exponent s, p(rank r) ~ r^-s). Each topic has its own Zipf law
  (another permutation); a topic's distribution at a layer is
  `(1 - topic_specialisation) * global + topic_specialisation * topic_own`.
- Vocabulary: token v belongs to topic `v mod (num_topics + 1)`; the last residue class is
  "common" (no topic). A request of topic t starts with topic t's shared prefix
  (`shared_prefix_blocks` full KV blocks, like a system prompt), followed by body tokens
  drawn from topic t's tokens (probability `topic_token_share`) or common tokens.
- Prefill routing is causal: token i's experts depend only on tokens 0..i. Its distribution
  mixes the topics seen so far in the prefix (counts of topic tokens, with a uniform prior)
  with a token-specific preferred expert (`token_affinity`), and its top-k distinct experts
  are an exponential-race (Gumbel-top-k) draw whose noise is a hash of the token prefix
  and a per-world seed.
  So requests sharing a token prefix have identical expert ids over that prefix, as in a
  real model, and prefix-cache summaries are exact.
- Decode: each decode token draws top-k distinct experts (exponential race, from `rng`)
  from `rho * own + (1 - rho) * ((1 - s) * topic + s * private)`, where `own` is the
  request's prefill expert distribution at that layer, `topic` its topic's distribution and
  `private` a distribution of the request's own that its prompt does not show (drawn per
  request and layer from a Dirichlet whose parameters are the topic's distribution: its mean
  is the topic's distribution and, with a total concentration of 1, each draw puts most of
  its mass on a few of the topic's popular experts: requests vary around their topic while
  the workload's overall popularity stays the topics'); rho tunes how well a request's
  prefill predicts its decode experts, s (`request_specificity`, default 0: no private
  part, no extra draws) how much requests of one topic differ in what they decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eldr.core.stats import dot
from eldr.core.workload.trace import EXPERT_ID_DTYPE, ModelGeometry, RequestTrace, TraceSet

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """SplitMix64 finaliser on a Python int (stable everywhere, no global state)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised over a uint64 array (wrapping arithmetic)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _unit_interval(bits: np.ndarray) -> np.ndarray:
    """Map uint64 hashes to floats strictly inside (0, 1)."""
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def zipf_weights(n: int, exponent: float) -> np.ndarray:
    """Normalised Zipf probabilities for ranks 1..n: p(r) ~ r^-exponent (float64 [n])."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if exponent < 0:
        raise ValueError(f"Zipf exponent must be non-negative, got {exponent}")
    w: np.ndarray = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    return np.asarray(w / w.sum(), dtype=np.float64)


def fit_zipf_exponent(counts: np.ndarray) -> float:
    """Least-squares Zipf exponent of expert popularity counts.

    counts: [experts] or [layers, experts]; per row, regress log(count) on log(rank) over
    the positive counts sorted in decreasing order; returns the mean of -slope over rows.
    """
    arr = np.asarray(counts, dtype=np.float64)
    rows = arr[None, :] if arr.ndim == 1 else arr
    if rows.ndim != 2:
        raise ValueError(f"counts must be 1-D or 2-D, got shape {arr.shape}")
    slopes = []
    for row in rows:
        pos = np.sort(row[row > 0])[::-1]
        if pos.shape[0] < 2:
            continue
        x = np.log(np.arange(1, pos.shape[0] + 1, dtype=np.float64))
        y = np.log(pos)
        xc = x - x.mean()
        slopes.append(-float(dot(xc, y - y.mean()) / dot(xc, xc)))
    if not slopes:
        raise ValueError("need at least two positive counts in some row to fit an exponent")
    return float(np.mean(slopes))


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of a synthetic workload. Ranges are inclusive (lo, hi).

    prompt_len_range counts the request-specific prompt tokens, after the topic's shared
    prefix of `shared_prefix_blocks * block_size` tokens.
    """

    num_topics: int = 4
    num_moe_layers: int = 8
    num_experts: int = 32
    top_k: int = 2
    popularity_skew: float = 1.0
    topic_specialisation: float = 0.6
    prompt_len_range: tuple[int, int] = (8, 64)
    decode_len_range: tuple[int, int] = (16, 128)
    rho: float = 0.6
    shared_prefix_blocks: int = 1
    block_size: int = 16
    vocab_size: int = 32_000
    token_affinity: float = 0.3
    topic_token_share: float = 0.8
    request_specificity: float = 0.0

    def __post_init__(self) -> None:
        if self.num_topics <= 0:
            raise ValueError(f"num_topics must be positive, got {self.num_topics}")
        if self.num_moe_layers <= 0:
            raise ValueError(f"num_moe_layers must be positive, got {self.num_moe_layers}")
        if not 0 < self.num_experts <= np.iinfo(EXPERT_ID_DTYPE).max:
            raise ValueError(f"num_experts out of range: {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")
        if self.popularity_skew < 0:
            raise ValueError(f"popularity_skew must be >= 0, got {self.popularity_skew}")
        for name in ("topic_specialisation", "rho", "topic_token_share", "request_specificity"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        if not 0.0 <= self.token_affinity < 1.0:
            raise ValueError(f"token_affinity must lie in [0, 1), got {self.token_affinity}")
        for name in ("prompt_len_range", "decode_len_range"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got {(lo, hi)}")
        if self.prompt_len_range[0] == 0 and self.shared_prefix_blocks == 0:
            raise ValueError("prompts could be empty: raise prompt_len_range[0] or add a prefix")
        if self.shared_prefix_blocks < 0:
            raise ValueError(f"shared_prefix_blocks must be >= 0, got {self.shared_prefix_blocks}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 2 * (self.num_topics + 1) <= self.vocab_size <= 2**32:
            raise ValueError(
                f"vocab_size must lie in [{2 * (self.num_topics + 1)}, 2**32], "
                f"got {self.vocab_size}"
            )

    @property
    def geometry(self) -> ModelGeometry:
        """All layers are MoE layers in a synthetic model."""
        return ModelGeometry(
            num_layers=self.num_moe_layers,
            moe_layers=tuple(range(self.num_moe_layers)),
            num_experts=self.num_experts,
            top_k=self.top_k,
        )

    @property
    def prefix_tokens(self) -> int:
        return self.shared_prefix_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"topics={self.num_topics} L={self.num_moe_layers} E={self.num_experts} "
            f"k={self.top_k} skew={self.popularity_skew:g} "
            f"specialisation={self.topic_specialisation:g} rho={self.rho:g} "
            f"prompt={self.prompt_len_range[0]}-{self.prompt_len_range[1]} "
            f"decode={self.decode_len_range[0]}-{self.decode_len_range[1]} "
            f"prefix_blocks={self.shared_prefix_blocks} block={self.block_size} "
            f"vocab={self.vocab_size} affinity={self.token_affinity:g} "
            f"topic_share={self.topic_token_share:g}"
            + (f" specificity={self.request_specificity:g}" if self.request_specificity else "")
        )


@dataclass(frozen=True, eq=False)
class SyntheticWorld:
    """One drawn generative model: share it between calibration and evaluation sets.

    topic_dist: float64 [topics, L, E] per-topic expert distributions; global_dist: float64
    [L, E]; prefixes: uint32 [topics, prefix_tokens]; model_seed: routing hash seed.
    """

    spec: SyntheticSpec
    model_seed: int
    global_dist: np.ndarray = field(repr=False)
    topic_dist: np.ndarray = field(repr=False)
    prefixes: np.ndarray = field(repr=False)

    @property
    def topic_names(self) -> tuple[str, ...]:
        width = len(str(self.spec.num_topics - 1))
        return tuple(f"topic{t:0{width}d}" for t in range(self.spec.num_topics))

    def token_topics(self, token_ids: np.ndarray) -> np.ndarray:
        """Topic of each token (int64), num_topics for common tokens."""
        return (np.asarray(token_ids, dtype=np.int64) % (self.spec.num_topics + 1)).astype(np.int64)

    def sample_topic_tokens(self, topic: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """n token ids of one topic (topic == num_topics: common tokens), uint32."""
        classes = self.spec.num_topics + 1
        per_class = self.spec.vocab_size // classes
        return (rng.integers(0, per_class, size=n, dtype=np.int64) * classes + topic).astype(
            np.uint32
        )

    def route_prefill(self, token_ids: np.ndarray) -> np.ndarray:
        """Causal prefill routing: int16 [tokens, L, top_k], row i depends on tokens 0..i."""
        spec = self.spec
        tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        n = tokens.shape[0]
        L, E, T, k = spec.num_moe_layers, spec.num_experts, spec.num_topics, spec.top_k
        if n == 0:
            return np.zeros((0, L, k), dtype=EXPERT_ID_DTYPE)
        # Context: cumulative topic counts (common tokens add none) plus a uniform prior.
        topics = self.token_topics(tokens)
        onehot = np.zeros((n, T + 1), dtype=np.float64)
        onehot[np.arange(n), topics] = 1.0
        ctx_counts = np.cumsum(onehot[:, :T], axis=0) + 1.0 / T
        weights = ctx_counts / ctx_counts.sum(axis=1, keepdims=True)
        # einsum, not @: tiny matmuls through the threaded BLAS are slow on busy machines.
        probs = np.einsum("nt,tk->nk", weights, self.topic_dist.reshape(T, L * E)).reshape(n, L, E)
        probs *= 1.0 - spec.token_affinity
        # Token-specific preferred expert per layer (a fixed function of the token id).
        layer_keys = np.arange(L, dtype=np.uint64) * np.uint64(0x100000001B3)
        pref_bits = _mix64_array(
            (tokens.astype(np.uint64) ^ np.uint64(self.model_seed))[:, None] + layer_keys[None, :]
        )
        pref = (pref_bits % np.uint64(E)).astype(np.int64)
        np.add.at(
            probs,
            (np.arange(n)[:, None], np.arange(L)[None, :], pref),
            spec.token_affinity,
        )
        # Noise keyed by a hash chain over the token prefix: identical prefixes, identical noise.
        state = self.model_seed
        prefix_keys = np.empty(n, dtype=np.uint64)
        for i, tok in enumerate(tokens.tolist()):
            state = _mix64(state ^ _mix64(tok))
            prefix_keys[i] = state
        cell = np.arange(L * E, dtype=np.uint64).reshape(L, E) + np.uint64(1)
        bits = _mix64_array(prefix_keys[:, None, None] ^ (cell[None] * np.uint64(_GOLDEN)))
        # Exponential race (equivalent to Gumbel-top-k): the k smallest Exp(1)/p are a draw
        # of k distinct experts without replacement, proportional to p.
        race = -np.log(_unit_interval(bits).astype(np.float32)) / probs.astype(np.float32)
        return _k_smallest(race, k)

    def decode_distribution(
        self, prefill: np.ndarray, topic: int, private: np.ndarray | None = None
    ) -> np.ndarray:
        """`rho * own + (1 - rho) * ((1 - s) * topic + s * private)` per layer: float64
        [L, E] (`private`: the request's own [L, E] distribution; None: s taken as 0)."""
        spec = self.spec
        L, E = spec.num_moe_layers, spec.num_experts
        if prefill.shape[0]:
            flat = prefill.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]
            own = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E).astype(np.float64)
            own /= own.sum(axis=1, keepdims=True)
        else:
            own = self.topic_dist[topic]
        rest = self.topic_dist[topic]
        if private is not None and spec.request_specificity > 0:
            s = spec.request_specificity
            rest = (1.0 - s) * rest + s * private
        mixed: np.ndarray = spec.rho * own + (1.0 - spec.rho) * rest
        return mixed


def _k_smallest(race: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k smallest race times along the last axis, first arrival first (int16)."""
    if k == 1:
        first: np.ndarray = np.argmin(race, axis=-1)[..., None]
        return first.astype(EXPERT_ID_DTYPE)
    part = np.argpartition(race, k - 1, axis=-1)[..., :k]
    part_times = np.take_along_axis(race, part, axis=-1)
    order = np.argsort(part_times, axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1).astype(EXPERT_ID_DTYPE)


def make_world(spec: SyntheticSpec, rng: np.random.Generator) -> SyntheticWorld:
    """Draw the generative model of a workload (popularity laws, prefixes, routing seed)."""
    L, E, T = spec.num_moe_layers, spec.num_experts, spec.num_topics
    zipf = zipf_weights(E, spec.popularity_skew)
    global_dist = np.empty((L, E), dtype=np.float64)
    for layer in range(L):
        global_dist[layer, rng.permutation(E)] = zipf
    own = np.empty((T, L, E), dtype=np.float64)
    for t in range(T):
        for layer in range(L):
            own[t, layer, rng.permutation(E)] = zipf
    share = spec.topic_specialisation
    topic_dist = (1.0 - share) * global_dist[None, :, :] + share * own
    model_seed = int(rng.integers(0, 2**63, dtype=np.int64))
    world = SyntheticWorld(
        spec=spec,
        model_seed=model_seed,
        global_dist=global_dist,
        topic_dist=topic_dist,
        prefixes=np.zeros((T, spec.prefix_tokens), dtype=np.uint32),
    )
    prefixes = np.stack(
        [world.sample_topic_tokens(t, spec.prefix_tokens, rng) for t in range(T)]
    ).reshape(T, spec.prefix_tokens)
    object.__setattr__(world, "prefixes", prefixes)
    return world


def generate(
    spec: SyntheticSpec,
    n_requests: int,
    rng: np.random.Generator,
    *,
    world: SyntheticWorld | None = None,
    id_prefix: str = "syn",
) -> TraceSet:
    """Generate n_requests synthetic request traces (synthetic=True, token_ids filled).

    Without `world` a new one is drawn from `rng` first; pass the same world to draw
    further requests (e.g. a calibration set and a disjoint evaluation set) from the same
    model. request ids are f"{id_prefix}-{i:06d}"; labels are topic names.
    """
    if n_requests < 0:
        raise ValueError(f"n_requests must be non-negative, got {n_requests}")
    if world is None:
        world = make_world(spec, rng)
    elif world.spec != spec:
        raise ValueError("world was drawn for a different SyntheticSpec")
    names = world.topic_names
    L, E, k = spec.num_moe_layers, spec.num_experts, spec.top_k
    traces: list[RequestTrace] = []
    for i in range(n_requests):
        topic = int(rng.integers(0, spec.num_topics))
        body_len = int(rng.integers(spec.prompt_len_range[0], spec.prompt_len_range[1] + 1))
        own_tokens = world.sample_topic_tokens(topic, body_len, rng)
        common = world.sample_topic_tokens(spec.num_topics, body_len, rng)
        use_common = rng.random(body_len) >= spec.topic_token_share
        body = np.where(use_common, common, own_tokens).astype(np.uint32)
        tokens = np.concatenate([world.prefixes[topic], body]).astype(np.uint32)
        prefill = world.route_prefill(tokens)
        decode_len = int(rng.integers(spec.decode_len_range[0], spec.decode_len_range[1] + 1))
        private = None
        if spec.request_specificity > 0:
            # Dirichlet(topic) per layer, by normalised gammas (tiny shapes give zeros).
            gammas = rng.standard_gamma(world.topic_dist[topic])
            private = gammas / np.maximum(gammas.sum(axis=1, keepdims=True), 1e-300)
        q = world.decode_distribution(prefill, topic, private).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv_q = np.float32(1.0) / q  # experts with q = 0 never arrive (inf)
        race = rng.standard_exponential(size=(decode_len, L, E), dtype=np.float32) * inv_q
        decode = _k_smallest(race, k) if decode_len else np.zeros((0, L, k), dtype=EXPERT_ID_DTYPE)
        traces.append(
            RequestTrace(
                request_id=f"{id_prefix}-{i:06d}",
                label=names[topic],
                prefill=prefill,
                decode=decode,
                token_ids=tokens,
            )
        )
    return TraceSet(
        geometry=spec.geometry,
        traces=tuple(traces),
        source=f"synthetic({spec.describe()})",
        synthetic=True,
    )
