"""Reader for the OLMoE project's aggregate expert-count file, to calibrate synthetic skew.

File: `expert_counts_by_domain.json` (see ../shared/data/README.md): a JSON list of
records `{hf_model_id, num_experts, top_k, domain, kind, layers, counts_per_layer, ...}`.
Only records of kind "expert_counts" (all top-k slots counted) are used here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from eldr.core.workload.synthetic import fit_zipf_exponent

OLMOE_MODEL_ID = "allenai/OLMoE-1B-7B-0924"


def load_domain_expert_counts(
    path: str | os.PathLike[str], hf_model_id: str = OLMOE_MODEL_ID
) -> dict[str, np.ndarray]:
    """Per-domain expert counts int64 [recorded layers, experts] of one model."""
    p = Path(path)
    try:
        records = json.loads(p.read_bytes())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(records, list):
        raise ValueError(f"{p}: expected a list of records")
    out: dict[str, np.ndarray] = {}
    for r in records:
        if not isinstance(r, dict) or r.get("hf_model_id") != hf_model_id:
            continue
        if r.get("kind") != "expert_counts":
            continue
        counts = np.asarray(r.get("counts_per_layer"), dtype=np.int64)
        if counts.ndim != 2 or counts.shape[1] != r.get("num_experts"):
            raise ValueError(f"{p}: record {r.get('domain')!r} has counts shaped {counts.shape}")
        out[str(r["domain"])] = counts
    if not out:
        raise ValueError(f"{p}: no 'expert_counts' records for model {hf_model_id!r}")
    return out


def popularity_skew(path: str | os.PathLike[str], hf_model_id: str = OLMOE_MODEL_ID) -> float:
    """Mean fitted Zipf exponent of per-layer expert popularity over the model's domains.

    A value for `SyntheticSpec.popularity_skew`; it describes the skew of one domain at one
    layer, i.e. of a topic's own distribution, not of a mixture of topics.
    """
    per_domain = load_domain_expert_counts(path, hf_model_id)
    return float(np.mean([fit_zipf_exponent(c) for c in per_domain.values()]))
