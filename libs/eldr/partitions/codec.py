"""Conversions of a `Partition` to and from its wire blob and its database record.

The trainer stores each fit as a `PartitionRecord` (SQL, the durable history) and publishes
it as a `PartitionBlob` (NATS object store, what routers load); both carry the same
content, so a router never needs the database.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.store.repo import PartitionRecord
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


def partition_to_record(
    p: Partition,
    *,
    seed: int,
    n_train: int,
    sha256: str,
    parent_version: int | None = None,
    note: str = "",
) -> PartitionRecord:
    cal = p.calibration
    return PartitionRecord(
        model=p.model,
        transform=cal.transform,
        num_moe_layers=cal.num_moe_layers,
        num_experts=cal.num_experts,
        seed=seed,
        n_train=n_train,
        centroids=p.centroids,
        owners=tuple(int(o) for o in p.owners),
        workers=p.workers,
        layer_mask=np.asarray(cal.layer_mask, dtype=bool),
        blob_sha256=sha256,
        idf=None if cal.idf is None else np.asarray(cal.idf, dtype=np.float32),
        metrics={k: float(v) for k, v in p.metrics.items() if np.isfinite(v)},
        parent_version=parent_version,
        note=note,
    )


def partition_from_record(rec: PartitionRecord, index_method: str = "auto") -> Partition:
    if rec.version is None:
        raise ValueError("a stored partition record has a version")
    calibration = Calibration(
        num_moe_layers=rec.num_moe_layers,
        num_experts=rec.num_experts,
        transform=rec.transform,
        idf=None if rec.idf is None else np.asarray(rec.idf, dtype=np.float32).reshape(-1),
        layer_mask=np.asarray(rec.layer_mask, dtype=bool),
    )
    return Partition(
        version=rec.version,
        model=rec.model,
        calibration=calibration,
        centroids=rec.centroids,
        owners=np.asarray(rec.owners, dtype=np.int64),
        workers=rec.workers,
        metrics={k: float(v) for k, v in dict(rec.metrics).items()},
        index_method=index_method,
    )
