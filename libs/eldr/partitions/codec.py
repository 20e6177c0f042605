"""Conversions of a `Partition` to and from its wire blob.

The blob is the one stored form of a partition version: the trainer stores its encoded
bytes in the database (`eldr.store.repo.PartitionRecord.blob_bytes`, the durable history)
and publishes the same bytes to the NATS object store (what routers load), so a router
never needs the database. Reading a version back from either is `partition_from_blob`.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.wire import NdArray, PartitionBlob, encode


def partition_to_blob(p: Partition) -> PartitionBlob:
    cal = p.calibration
    idf = None
    if cal.idf is not None:
        idf = NdArray.from_numpy(
            np.asarray(cal.idf, dtype=np.float32).reshape(cal.num_moe_layers, cal.num_experts)
        )
    return PartitionBlob(
        version=p.version,
        model=p.model,
        transform=cal.transform,
        num_moe_layers=cal.num_moe_layers,
        num_experts=cal.num_experts,
        idf=idf,
        layer_mask=NdArray.from_numpy(np.asarray(cal.layer_mask, dtype=np.uint8)),
        centroids=NdArray.from_numpy(p.centroids),
        owners=[int(o) for o in p.owners],
        workers=list(p.workers),
        metrics={k: float(v) for k, v in p.metrics.items() if np.isfinite(v)},
    )


def blob_sha256(blob: PartitionBlob) -> str:
    return hashlib.sha256(encode(blob)).hexdigest()


def partition_from_blob(blob: PartitionBlob, index_method: str = "auto") -> Partition:
    """Rebuild a router-side partition; raises ValueError on inconsistent content."""
    if blob.projection is not None:
        raise ValueError("partitions with a projection are not supported by this version")
    idf = None if blob.idf is None else blob.idf.to_numpy().reshape(-1)
    calibration = Calibration(
        num_moe_layers=blob.num_moe_layers,
        num_experts=blob.num_experts,
        transform=blob.transform,
        idf=idf,
        layer_mask=blob.layer_mask.to_numpy().astype(bool),
    )
    return Partition(
        version=blob.version,
        model=blob.model,
        calibration=calibration,
        centroids=blob.centroids.to_numpy(),
        owners=np.asarray(blob.owners, dtype=np.int64),
        workers=tuple(blob.workers),
        metrics=dict(blob.metrics),
        index_method=index_method,
    )
