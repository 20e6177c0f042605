"""Expert signatures of requests and their calibration (transform, IDF, layer mask).

A request's signature is built from its prefill expert counts [moe_layers, experts]:

1. transform: "raw" keeps the counts; "idf" multiplies entry (l, e) by
   `idf[l, e] = log((N + 1) / (df[l, e] + 1))`, where N is the number of calibration
   requests and df[l, e] how many of them activated expert e at layer l during prefill
   (experts every request uses carry no information and get weight 0);
2. layer mask: keep only the calibrated subset of MoE layers;
3. L2-normalise the whole vector (a zero vector stays zero).

The layer mask is chosen by forward-greedy selection on calibration data that has decode
profiles: on sampled request pairs, repeatedly add the MoE layer that most increases the
Spearman correlation between pairwise cosine distances of the masked prefill signals and
pairwise cosine distances of the requests' decode expert-count profiles; keep the greedy
prefix up to the peak correlation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from eldr.core.stats import dot, rank_unchecked
from eldr.core.workload.trace import ModelGeometry

TRANSFORMS: tuple[str, ...] = ("raw", "idf")
LAYER_SELECTIONS: tuple[str, ...] = ("greedy", "all")
DEFAULT_MAX_PAIRS = 30_000
CALIBRATION_FORMAT_VERSION = 1

# Rows and pairs are processed in chunks of about this many matrix entries, so that no
# [requests or pairs, layers * experts] temporary is materialised at once.
_CHUNK_ELEMENTS = 4_000_000


def _check_count_matrix(x: np.ndarray, name: str, dim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 2 or arr.shape[1] != dim:
        raise ValueError(f"{name} must be shaped [requests, {dim}], got {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if arr.size:
        # min/max propagate NaN and expose inf without a full-size temporary mask.
        lo, hi = float(arr.min()), float(arr.max())
        if np.isnan(lo) or np.isnan(hi) or np.isinf(hi):
            raise ValueError(f"{name} contains NaN or infinite values")
        if lo < 0:
            raise ValueError(f"{name} must be non-negative counts")
    return arr


def compute_idf(prefill_counts: np.ndarray) -> np.ndarray:
    """IDF weights float32 [dim] from a calibration count matrix [N, dim].

    `idf = log((N + 1) / (df + 1))` with df the number of rows whose entry is positive.
    """
    arr = np.asarray(prefill_counts)
    if arr.ndim != 2:
        raise ValueError(f"prefill_counts must be 2-D [requests, dim], got {arr.shape}")
    n = arr.shape[0]
    df = np.count_nonzero(arr > 0, axis=0).astype(np.float64)
    idf: np.ndarray = np.log((n + 1.0) / (df + 1.0))
    return idf.astype(np.float32)


def sample_pairs(n: int, max_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Distinct unordered request pairs (i < j) as two int64 arrays.

    All n(n-1)/2 pairs (in lexicographic order) when that is at most max_pairs; otherwise
    max_pairs distinct pairs drawn uniformly with `rng`.
    """
    if n < 2:
        raise ValueError(f"need at least 2 requests to form a pair, got {n}")
    if max_pairs <= 0:
        raise ValueError(f"max_pairs must be positive, got {max_pairs}")
    total = n * (n - 1) // 2
    if total <= max_pairs:
        i, j = np.triu_indices(n, k=1)
        return i.astype(np.int64), j.astype(np.int64)
    chosen_keys = np.empty(0, dtype=np.int64)
    while chosen_keys.shape[0] < max_pairs:
        need = max_pairs - chosen_keys.shape[0]
        a = rng.integers(0, n, size=2 * need + 16, dtype=np.int64)
        b = rng.integers(0, n, size=2 * need + 16, dtype=np.int64)
        keep = a != b
        lo = np.minimum(a[keep], b[keep])
        hi = np.maximum(a[keep], b[keep])
        keys = lo * n + hi
        merged = np.concatenate([chosen_keys, keys])
        # Keep first occurrences in draw order so the sample stays uniform.
        _, first = np.unique(merged, return_index=True)
        chosen_keys = merged[np.sort(first)][:max_pairs]
    return chosen_keys // n, chosen_keys % n


def _cosine_distances(dots: np.ndarray, sq_i: np.ndarray, sq_j: np.ndarray) -> np.ndarray:
    denom = np.sqrt(sq_i * sq_j)
    cos: np.ndarray = np.divide(dots, denom, out=np.zeros_like(dots), where=denom > 0)
    return np.asarray(1.0 - cos)


@dataclass(frozen=True)
class GreedyStep:
    """One step of forward-greedy layer selection.

    layer: position among the MoE layers (0..L-1); model_layer: the model's layer id when
    known (else equal to layer); correlation: Spearman correlation of the mask after adding
    this layer (NaN when undefined, e.g. all distances equal).
    """

    layer: int
    model_layer: int
    correlation: float


def greedy_layer_mask(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    num_moe_layers: int,
    num_experts: int,
    rng: np.random.Generator,
    max_pairs: int = DEFAULT_MAX_PAIRS,
    moe_layer_ids: tuple[int, ...] | None = None,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, list[GreedyStep], int]:
    """Forward-greedy MoE layer selection against decode summaries.

    prefill_counts: [N, L*E] prefill counts; weights: optional [L*E] per-entry factors
    applied to them first (the IDF for the "idf" transform); decode_counts: [N, L*E] decode
    expert counts. Returns (bool mask [L], the full greedy trace over all L steps, number
    of pairs used). The mask is the greedy prefix up to the peak correlation (the earliest
    peak on ties). If no step has a defined correlation, the mask keeps all layers.

    Cost: one pass over the pairs to precompute per-pair per-layer dot products and
    per-request per-layer squared norms; each candidate set is then scored in O(P) plus a
    rank of P distances. Memory: O(P * L) plus one chunk of rows at a time.
    """
    L, E = num_moe_layers, num_experts
    dim = L * E
    x = _check_count_matrix(prefill_counts, "prefill_counts", dim)
    d = _check_count_matrix(decode_counts, "decode_counts", dim)
    if x.shape[0] != d.shape[0]:
        raise ValueError(
            f"prefill_counts has {x.shape[0]} requests but decode_counts has {d.shape[0]}"
        )
    if moe_layer_ids is not None and len(moe_layer_ids) != L:
        raise ValueError(f"moe_layer_ids has {len(moe_layer_ids)} entries, expected {L}")
    w: np.ndarray | None = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float32)
        if w.shape != (dim,):
            raise ValueError(f"weights must be shaped [{dim}], got {w.shape}")
    ids = moe_layer_ids if moe_layer_ids is not None else tuple(range(L))
    n = x.shape[0]
    pi, pj = sample_pairs(n, max_pairs, rng)
    n_pairs = pi.shape[0]

    def signals(rows: np.ndarray | slice) -> np.ndarray:
        chunk = np.asarray(x[rows], dtype=np.float32)
        if w is not None:
            chunk = chunk * w
        return chunk.reshape(-1, L, E)

    chunk_rows = max(1, _CHUNK_ELEMENTS // dim)
    sq = np.empty((n, L), dtype=np.float64)
    for start in range(0, n, chunk_rows):
        part = signals(slice(start, start + chunk_rows))
        sq[start : start + chunk_rows] = np.einsum("nle,nle->nl", part, part, dtype=np.float64)
    # Layer-major [L, P] so each candidate layer's column is contiguous.
    dots = np.empty((L, n_pairs), dtype=np.float64)
    dec_dots = np.empty(n_pairs, dtype=np.float64)
    for start in range(0, n_pairs, chunk_rows):
        sl = slice(start, start + chunk_rows)
        a, b = pi[sl], pj[sl]
        dots[:, sl] = np.einsum("ple,ple->lp", signals(a), signals(b), dtype=np.float64)
        da = np.asarray(d[a], dtype=np.float32)
        db = np.asarray(d[b], dtype=np.float32)
        dec_dots[sl] = np.einsum("pk,pk->p", da, db, dtype=np.float64)
    dec_sq = np.empty(n, dtype=np.float64)
    for start in range(0, n, chunk_rows):
        part_d = np.asarray(d[start : start + chunk_rows], dtype=np.float32)
        dec_sq[start : start + chunk_rows] = np.einsum("nk,nk->n", part_d, part_d, dtype=np.float64)
    sq_i = np.ascontiguousarray(sq[pi].T)  # [L, P]
    sq_j = np.ascontiguousarray(sq[pj].T)
    # Ranks of n items (average ties) always have mean (n + 1) / 2, so centring is a shift.
    rank_mean = (n_pairs + 1) / 2.0
    dec_c = rank_unchecked(_cosine_distances(dec_dots, dec_sq[pi], dec_sq[pj])) - rank_mean
    dec_norm = float(np.sqrt(dot(dec_c, dec_c)))

    def spearman_to_decode(dist: np.ndarray) -> float:
        # scipy.stats.spearmanr(dist, decode distances), to 1e-15 (tests/unit/core/test_stats.py),
        # reusing the decode ranks: spearmanr made the selection 3.5x slower (stats.py).
        rc = rank_unchecked(dist) - rank_mean
        denom = float(np.sqrt(dot(rc, rc))) * dec_norm
        if denom == 0.0:
            return float("nan")
        return float(np.clip(dot(rc, dec_c) / denom, -1.0, 1.0))

    chosen: list[int] = []
    remaining = list(range(L))
    cur_dots = np.zeros(n_pairs, dtype=np.float64)
    cur_sq_i = np.zeros(n_pairs, dtype=np.float64)
    cur_sq_j = np.zeros(n_pairs, dtype=np.float64)
    trace: list[GreedyStep] = []
    while remaining:
        best_layer = -1
        best_corr = -np.inf
        best_raw = float("nan")
        for layer in remaining:
            dist = _cosine_distances(
                cur_dots + dots[layer], cur_sq_i + sq_i[layer], cur_sq_j + sq_j[layer]
            )
            corr = spearman_to_decode(dist)
            score = corr if np.isfinite(corr) else -np.inf
            if best_layer < 0 or score > best_corr:
                best_layer, best_corr, best_raw = layer, score, corr
        chosen.append(best_layer)
        remaining.remove(best_layer)
        cur_dots += dots[best_layer]
        cur_sq_i += sq_i[best_layer]
        cur_sq_j += sq_j[best_layer]
        trace.append(GreedyStep(best_layer, ids[best_layer], float(best_raw)))

    corrs = np.array([s.correlation for s in trace], dtype=np.float64)
    mask = np.zeros(L, dtype=bool)
    if np.any(np.isfinite(corrs)):
        peak = int(np.nanargmax(corrs))  # first index of the maximum
        mask[chosen[: peak + 1]] = True
    else:
        mask[:] = True
    return mask, trace, n_pairs


@dataclass(frozen=True, eq=False)
class Calibration:
    """How to turn prefill counts into a signature: transform, IDF weights, layer mask.

    idf: float32 [num_moe_layers * num_experts] for transform "idf", None for "raw".
    layer_mask: bool [num_moe_layers], at least one True. Arrays are stored read-only.
    """

    num_moe_layers: int
    num_experts: int
    transform: str
    idf: np.ndarray | None
    layer_mask: np.ndarray
    _cols: np.ndarray = field(init=False, repr=False)
    _weights: np.ndarray | None = field(init=False, repr=False)
    _col_of: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        L, E = self.num_moe_layers, self.num_experts
        if L <= 0 or E <= 0:
            raise ValueError(f"num_moe_layers and num_experts must be positive, got {L}, {E}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        mask = np.asarray(self.layer_mask)
        if mask.shape != (L,) or mask.dtype != np.bool_:
            raise ValueError(f"layer_mask must be bool [{L}], got {mask.dtype} {mask.shape}")
        if not mask.any():
            raise ValueError("layer_mask must keep at least one layer")
        mask = mask.copy()
        mask.setflags(write=False)
        object.__setattr__(self, "layer_mask", mask)
        idf: np.ndarray | None = None
        if self.transform == "idf":
            if self.idf is None:
                raise ValueError("transform 'idf' needs idf weights")
            idf = np.asarray(self.idf, dtype=np.float32).copy()
            if idf.shape != (L * E,):
                raise ValueError(f"idf must be shaped [{L * E}], got {idf.shape}")
            if not np.all(np.isfinite(idf)) or float(idf.min()) < 0:
                raise ValueError("idf weights must be finite and non-negative")
            idf.setflags(write=False)
        elif self.idf is not None:
            raise ValueError("transform 'raw' takes no idf weights")
        object.__setattr__(self, "idf", idf)
        cols = (np.flatnonzero(mask)[:, None] * E + np.arange(E)[None, :]).ravel()
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_weights", None if idf is None else idf[cols])
        col_of = np.full(L * E, -1, dtype=np.int64)
        col_of[cols] = np.arange(cols.size)
        object.__setattr__(self, "_col_of", col_of)

    @property
    def dim(self) -> int:
        """Length of a signature: kept layers x experts."""
        return int(self._cols.shape[0])

    @property
    def kept_layers(self) -> tuple[int, ...]:
        """Positions (0..L-1) of the MoE layers the mask keeps."""
        return tuple(int(i) for i in np.flatnonzero(self.layer_mask))

    def apply(self, counts: np.ndarray) -> np.ndarray:
        """Unit-L2 float32 signatures from prefill counts.

        counts: one request as [L*E] or [L, E] (returns [dim]), or a batch as [N, L*E] or
        [N, L, E] (returns [N, dim]). With L == 1 a 2-D [1, E] input is read as a batch of
        one. Zero vectors stay zero (no NaN).
        """
        L, E = self.num_moe_layers, self.num_experts
        arr = np.asarray(counts)
        if arr.dtype.kind not in "iuf":
            raise ValueError(f"counts must be numeric, got dtype {arr.dtype}")
        single = False
        if arr.ndim == 1 and arr.shape[0] == L * E:
            single = True
            batch = arr[None, :]
        elif arr.ndim == 2 and arr.shape == (L, E) and L > 1:
            single = True
            batch = arr.reshape(1, L * E)
        elif arr.ndim == 2 and arr.shape[1] == L * E:
            batch = arr
        elif arr.ndim == 3 and arr.shape[1:] == (L, E):
            batch = arr.reshape(arr.shape[0], L * E)
        else:
            raise ValueError(
                f"counts must be shaped [{L * E}], [{L}, {E}], [N, {L * E}] or [N, {L}, {E}]; "
                f"got {arr.shape}"
            )
        x = batch[:, self._cols].astype(np.float32)
        if self._weights is not None:
            x *= self._weights
        norms = np.sqrt(np.einsum("nk,nk->n", x, x, dtype=np.float64)).astype(np.float32)
        np.divide(x, norms[:, None], out=x, where=norms[:, None] > 0)
        return x[0] if single else x

    def apply_cells(self, idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """`apply` of one request given as its non-zero cells (flat indices into [L * E],
        in range, and their counts): the unit float32 signature [dim], touching only the
        cells the prompt routed to (the router's path)."""
        cols = self._col_of[idx]
        kept = cols >= 0
        out = np.zeros(self._cols.size, dtype=np.float32)
        x = vals[kept].astype(np.float32)
        if self._weights is not None:
            x *= self.idf[idx[kept]]  # type: ignore[index]
        wide = x.astype(np.float64)
        norm = np.float32(np.sqrt(wide @ wide))
        if norm > 0:
            out[cols[kept]] = x / norm
        return out

    def to_arrays(self) -> dict[str, np.ndarray | int | str]:
        """Plain dict of numpy arrays and scalars for persistence and the wire."""
        out: dict[str, np.ndarray | int | str] = {
            "version": CALIBRATION_FORMAT_VERSION,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts,
            "transform": self.transform,
            "layer_mask": np.array(self.layer_mask, dtype=bool),
        }
        if self.idf is not None:
            out["idf"] = np.array(self.idf, dtype=np.float32)
        return out

    @classmethod
    def from_arrays(cls, data: Mapping[str, object]) -> Calibration:
        """Inverse of `to_arrays`; validates everything and names what is wrong.

        Scalars may also arrive as 0-d numpy arrays (as `np.load` of an .npz returns them).
        """

        def scalar(value: object) -> object:
            if isinstance(value, np.ndarray) and value.ndim == 0:
                return value.item()
            return value

        version = scalar(data.get("version"))
        if version != CALIBRATION_FORMAT_VERSION:
            raise ValueError(
                f"calibration format version {version!r} unsupported "
                f"(expected {CALIBRATION_FORMAT_VERSION})"
            )
        for key in ("num_moe_layers", "num_experts", "transform", "layer_mask"):
            if key not in data:
                raise ValueError(f"calibration data lacks {key!r}")
        L, E = scalar(data["num_moe_layers"]), scalar(data["num_experts"])
        transform = scalar(data["transform"])
        if not isinstance(L, int | np.integer) or not isinstance(E, int | np.integer):
            raise ValueError("num_moe_layers and num_experts must be integers")
        if not isinstance(transform, str):
            raise ValueError(f"transform must be a string, got {type(transform).__name__}")
        mask = np.asarray(data["layer_mask"])
        if mask.dtype != np.bool_:
            raise ValueError(f"layer_mask must be bool, got {mask.dtype}")
        idf_raw = data.get("idf")
        idf = None if idf_raw is None else np.asarray(idf_raw)
        if idf is not None and idf.dtype.kind != "f":
            raise ValueError(f"idf must be floating point, got {idf.dtype}")
        return cls(int(L), int(E), transform, idf, mask)


@dataclass(frozen=True)
class CalibrationReport:
    """What `fit_calibration` did, for reports and logs.

    layer_selection_used: "greedy" or "all" (greedy falls back to all layers without decode
    counts or with fewer than 2 requests; `notes` then says why). greedy_trace: every greedy
    step (empty when greedy did not run). peak_correlation: Spearman correlation of the
    chosen mask; all_layers_correlation: the same with every layer kept (both NaN when
    greedy did not run).
    """

    n_requests: int
    transform: str
    layer_selection_requested: str
    layer_selection_used: str
    n_pairs: int
    greedy_trace: tuple[GreedyStep, ...]
    kept_layers: tuple[int, ...]
    peak_correlation: float
    all_layers_correlation: float
    notes: tuple[str, ...] = ()


def fit_calibration(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray | None,
    geometry: ModelGeometry,
    *,
    transform: str = "idf",
    layer_selection: str = "greedy",
    rng: np.random.Generator,
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> tuple[Calibration, CalibrationReport]:
    """Fit a signature calibration on N calibration requests.

    prefill_counts, decode_counts: float32 [N, L*E] as from `counts_matrix` (decode may be
    None; greedy selection then falls back to all layers and the report says so). Pure
    function: the only randomness is pair sampling from `rng`.
    """
    L, E = geometry.num_moe_layers, geometry.num_experts
    dim = geometry.signature_dim
    if transform not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
    if layer_selection not in LAYER_SELECTIONS:
        raise ValueError(
            f"layer_selection must be one of {LAYER_SELECTIONS}, got {layer_selection!r}"
        )
    prefill = _check_count_matrix(prefill_counts, "prefill_counts", dim)
    n = prefill.shape[0]
    if n == 0:
        raise ValueError("calibration needs at least one request")
    decode = None
    if decode_counts is not None:
        decode = _check_count_matrix(decode_counts, "decode_counts", dim)
        if decode.shape[0] != n:
            raise ValueError(
                f"prefill_counts has {n} requests but decode_counts has {decode.shape[0]}"
            )

    idf = compute_idf(prefill) if transform == "idf" else None
    notes: list[str] = []
    used = layer_selection
    if layer_selection == "greedy" and decode is None:
        used = "all"
        notes.append("no decode counts given: greedy layer selection skipped, all layers kept")
    elif layer_selection == "greedy" and n < 2:
        used = "all"
        notes.append(f"{n} request(s): greedy layer selection needs >= 2, all layers kept")

    trace: list[GreedyStep] = []
    n_pairs = 0
    peak = float("nan")
    all_corr = float("nan")
    if used == "greedy":
        assert decode is not None
        mask, trace, n_pairs = greedy_layer_mask(
            prefill, decode, L, E, rng, max_pairs, moe_layer_ids=geometry.moe_layers, weights=idf
        )
        chosen_corr = [s.correlation for s in trace][: int(mask.sum())]
        peak = chosen_corr[-1] if chosen_corr else float("nan")
        all_corr = trace[-1].correlation
        if mask.all() and not np.any(np.isfinite([s.correlation for s in trace])):
            notes.append("correlation undefined at every greedy step: all layers kept")
    else:
        mask = np.ones(L, dtype=bool)

    calibration = Calibration(L, E, transform, idf, mask)
    report = CalibrationReport(
        n_requests=n,
        transform=transform,
        layer_selection_requested=layer_selection,
        layer_selection_used=used,
        n_pairs=n_pairs,
        greedy_trace=tuple(trace),
        kept_layers=calibration.kept_layers,
        peak_correlation=float(peak),
        all_layers_correlation=float(all_corr),
        notes=tuple(notes),
    )
    return calibration, report
