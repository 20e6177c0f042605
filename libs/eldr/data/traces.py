"""Loader for the public per-request MoE routing trace format (JSON, one file per request).

Format (Yu et al., "Patterns behind Chaos", arXiv:2510.05497; Hugging Face dataset
`core12345/MoE_expert_selection_trace`): a file is a JSON list of steps. `steps[0]` is the
prefill, `{"<layer_id>": [[e, ...], ...] | null}` with one inner list (the routed top-k
expert ids) per prompt token; `steps[i]`, i >= 1, is decode token i with exactly one inner
list per MoE layer. Dense layers are `null`. There are no token ids.

Layout: `<root>/<label>/<n>.json`. Any depth is accepted, so the full Hugging Face layout
(`profiling_result/<org>/<model>/<benchmark>/<subject>/<n>.json`) works too: a request's
label is the path of its directory relative to `root` (`"anatomy"`, or `"mmlu/anatomy"` when
pointed at a model directory); files directly in `root` get `root`'s name as label. Only
`*.json` files whose stem is a decimal integer are trace files; hidden entries (".*") are
skipped. All files must share one geometry, so point the loader at one model's directory.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eldr.core.workload.trace import EXPERT_ID_DTYPE, ModelGeometry, RequestTrace, TraceSet
from eldr.errors import InputError

log = logging.getLogger(__name__)

_ID_MAX = int(np.iinfo(EXPERT_ID_DTYPE).max)


class TraceFormatError(InputError):
    """A trace file or directory does not follow the format; the message names the file."""


class _Parsed:
    """One file's content after validation (internal)."""

    __slots__ = ("decode", "layer_count", "moe_layers", "path", "prefill", "top_k")

    def __init__(
        self,
        path: Path,
        layer_count: int,
        moe_layers: tuple[int, ...],
        top_k: int,
        prefill: np.ndarray,
        decode: np.ndarray,
    ) -> None:
        self.path = path
        self.layer_count = layer_count
        self.moe_layers = moe_layers
        self.top_k = top_k
        self.prefill = prefill
        self.decode = decode


def _fail(path: Path, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}: {what}")


def _layer_keys(path: Path, step: dict[str, Any]) -> list[int]:
    keys: list[int] = []
    for k in step:
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise _fail(path, f"step 0 has layer key {k!r}, expected a decimal layer id")
        keys.append(int(k))
    keys.sort()
    if not keys:
        raise _fail(path, "step 0 has no layer keys")
    if keys != list(range(len(keys))):
        missing = sorted(set(range(keys[-1] + 1)) - set(keys))
        raise _fail(path, f"layer keys must be 0..{len(keys) - 1}; missing {missing[:10]}")
    return keys


def _id_array(path: Path, rows: list[Any], where: str) -> np.ndarray:
    """Stack token rows (lists of expert ids) into int64 [rows, top_k]; validate values."""
    for r, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise _fail(path, f"{where}: token {r} is {row!r}, expected a non-empty id list")
    try:
        arr = np.array(rows)
    except ValueError:
        lens = sorted({len(row) for row in rows})
        raise _fail(path, f"{where}: top-k inconsistent (expert lists of lengths {lens})") from None
    if arr.ndim != 2:
        raise _fail(path, f"{where}: expert lists must hold plain integers")
    if arr.dtype.kind not in "iu":
        raise _fail(path, f"{where}: expert ids must be integers, found dtype {arr.dtype}")
    if int(arr.min()) < 0:
        raise _fail(path, f"{where}: negative expert id {int(arr.min())}")
    if int(arr.max()) > _ID_MAX:
        raise _fail(path, f"{where}: expert id {int(arr.max())} exceeds {_ID_MAX}")
    return arr.astype(np.int64, copy=False)


def _parse_file(path: Path) -> _Parsed:
    try:
        steps = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"not valid JSON ({exc})") from None
    if not isinstance(steps, list):
        raise _fail(path, f"top level is {type(steps).__name__}, expected a list of steps")
    if not steps:
        raise _fail(path, "empty list: no prefill step")
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise _fail(path, f"step {i} is {type(step).__name__}, expected an object")

    first: dict[str, Any] = steps[0]
    keys = _layer_keys(path, first)
    key_strs = [str(k) for k in keys]
    moe = tuple(k for k in keys if first[str(k)] is not None)
    if not moe:
        raise _fail(path, "prefill step has no MoE layer (every layer is null)")
    moe_strs = [str(k) for k in moe]
    dense_strs = [str(k) for k in keys if first[str(k)] is None]

    per_layer = []
    for s in moe_strs:
        val = first[s]
        if not isinstance(val, list):
            raise _fail(path, f"step 0 layer {s} is {type(val).__name__}, expected a list")
        per_layer.append(val)
    token_counts = {len(v) for v in per_layer}
    if len(token_counts) != 1:
        detail = ", ".join(f"layer {s}: {len(v)}" for s, v in zip(moe_strs, per_layer, strict=True))
        raise _fail(path, f"prefill token count differs across MoE layers ({detail})")
    n_prompt = token_counts.pop()
    if n_prompt == 0:
        raise _fail(path, "prefill has no tokens")
    flat_rows = [row for v in per_layer for row in v]
    pre = _id_array(path, flat_rows, "prefill")
    top_k = pre.shape[1]
    # Stored layer-major in JSON; the core wants [tokens, layers, top_k].
    prefill = pre.reshape(len(moe), n_prompt, top_k).transpose(1, 0, 2)

    key_set = set(key_strs)
    decode_rows: list[Any] = []
    for i in range(1, len(steps)):
        step = steps[i]
        if step.keys() != key_set:
            missing = sorted(key_set - step.keys(), key=_sort_key)
            extra = sorted(step.keys() - key_set, key=_sort_key)
            raise _fail(path, f"step {i} layer keys differ: missing {missing}, extra {extra}")
        for s in moe_strs:
            val = step[s]
            if not isinstance(val, list):
                raise _fail(path, f"step {i} MoE layer {s} is {val!r}, expected [[ids]]")
            if len(val) != 1:
                raise _fail(path, f"decode step {i} layer {s} has {len(val)} tokens, expected 1")
            decode_rows.append(val[0])
        for s in dense_strs:
            if step[s] is not None:
                raise _fail(
                    path, f"step {i} layer {s} is not null but is dense in the prefill step"
                )
    n_decode = len(steps) - 1
    if n_decode:
        dec = _id_array(path, decode_rows, "decode")
        if dec.shape[1] != top_k:
            raise _fail(path, f"top-k inconsistent: prefill {top_k}, decode {dec.shape[1]}")
        decode = dec.reshape(n_decode, len(moe), top_k)
    else:
        decode = np.zeros((0, len(moe), top_k), dtype=np.int64)
    return _Parsed(path, len(keys), moe, top_k, prefill, decode)


def _sort_key(s: str) -> tuple[int, str]:
    return (int(s), s) if s.isdigit() else (1 << 30, s)


def find_trace_files(root: Path) -> list[tuple[str, Path]]:
    """(label, path) of every trace file under root: labels sorted, files numerically."""
    root = Path(root)
    if not root.is_dir():
        raise TraceFormatError(f"{root}: not a directory")
    found: dict[str, list[tuple[int, Path]]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        rel = here.relative_to(root).as_posix()
        label = root.resolve().name if rel == "." else rel
        for name in filenames:
            stem, ext = os.path.splitext(name)
            if ext == ".json" and stem.isascii() and stem.isdigit():
                found.setdefault(label, []).append((int(stem), here / name))
    return [(label, p) for label in sorted(found) for _, p in sorted(found[label])]


def load_trace_dir(
    path: str | os.PathLike[str],
    *,
    num_experts: int | None = None,
    labels: Sequence[str] | None = None,
    limit_per_label: int | None = None,
) -> TraceSet:
    """Load a directory of trace files into a TraceSet (synthetic=False).

    Geometry comes from the data: total layers = number of layer keys, MoE layers = those
    whose entries are non-null, top_k = length of the inner lists, num_experts = the given
    value (ids must be below it) or max expert id + 1 over all loaded files (for the real
    Llama-4-Maverick data pass 128 to be safe; every expert does occur in the 255-request
    development subset). Order is deterministic: labels sorted, files by numeric stem.
    request_id is "<label>/<stem>". token_ids are None (the format has none; see
    `eldr.core.signature.blocks.trace_token_ids` for stand-ins).

    labels: load only these labels (ValueError if one is absent); limit_per_label: at most
    this many files per label (the numerically first). Raises TraceFormatError on malformed
    input, naming the file and the problem.
    """
    root = Path(path)
    if num_experts is not None and not 0 < num_experts <= _ID_MAX:
        raise ValueError(f"num_experts must lie in [1, {_ID_MAX}], got {num_experts}")
    if limit_per_label is not None and limit_per_label <= 0:
        raise ValueError(f"limit_per_label must be positive, got {limit_per_label}")
    files = find_trace_files(root)
    if not files:
        raise TraceFormatError(f"{root}: no trace files (<label>/<n>.json) found")
    if labels is not None:
        wanted = set(labels)
        present = {label for label, _ in files}
        absent = sorted(wanted - present)
        if absent:
            raise ValueError(f"{root}: labels not found: {absent}; present: {sorted(present)}")
        files = [(label, p) for label, p in files if label in wanted]
    if limit_per_label is not None:
        kept: list[tuple[str, Path]] = []
        per: dict[str, int] = {}
        for label, p in files:
            if per.get(label, 0) < limit_per_label:
                per[label] = per.get(label, 0) + 1
                kept.append((label, p))
        files = kept

    parsed: list[tuple[str, _Parsed]] = []
    ref: _Parsed | None = None
    max_id = -1
    for label, p in files:
        item = _parse_file(p)
        if ref is None:
            ref = item
        else:
            if item.layer_count != ref.layer_count:
                raise _fail(
                    p, f"{item.layer_count} layer keys, but {ref.path} has {ref.layer_count}"
                )
            if item.moe_layers != ref.moe_layers:
                raise _fail(
                    p,
                    f"MoE layer set {list(item.moe_layers)} differs from {ref.path}'s "
                    f"{list(ref.moe_layers)}",
                )
            if item.top_k != ref.top_k:
                raise _fail(p, f"top-k {item.top_k} differs from {ref.path}'s {ref.top_k}")
        file_max = max(int(item.prefill.max()), int(item.decode.max()) if item.decode.size else -1)
        if num_experts is not None and file_max >= num_experts:
            raise _fail(p, f"expert id {file_max} out of range for num_experts={num_experts}")
        max_id = max(max_id, file_max)
        parsed.append((label, item))
    assert ref is not None

    n_experts = num_experts if num_experts is not None else max_id + 1
    try:
        geometry = ModelGeometry(
            num_layers=ref.layer_count,
            moe_layers=ref.moe_layers,
            num_experts=n_experts,
            top_k=ref.top_k,
        )
    except ValueError as exc:
        raise TraceFormatError(f"{root}: inconsistent geometry: {exc}") from None

    traces = tuple(
        RequestTrace(
            request_id=f"{label}/{item.path.stem}",
            label=label,
            prefill=item.prefill.astype(EXPERT_ID_DTYPE),
            decode=item.decode.astype(EXPERT_ID_DTYPE),
        )
        for label, item in parsed
    )
    log.info(
        "loaded %d traces from %s: %d layers, %d MoE, %d experts, top-%d",
        len(traces),
        root,
        geometry.num_layers,
        geometry.num_moe_layers,
        geometry.num_experts,
        geometry.top_k,
    )
    return TraceSet(geometry=geometry, traces=traces, source=str(root), synthetic=False)
