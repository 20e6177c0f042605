"""Typed MessagePack wire schemas (msgspec Structs) for every message on the bus.

Import from here: `from eldr.wire import PrefillDone, decode, encode, WireError`.
"""

from eldr.wire.arrays import DTypeName, NdArray, SparseCounts
from eldr.wire.base import Message, WireError
from eldr.wire.codec import DEFAULT_MAX_BYTES, KIND_OF, SUPPORTED_VERSIONS, decode, encode
from eldr.wire.messages import (
    ALL_MESSAGE_TYPES,
    AssembleReply,
    AssembleRequest,
    BlockSummaryBatch,
    BlockSummaryMsg,
    CaptureStatus,
    DeadLetter,
    Decision,
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    DecodeProfile,
    LoadReport,
    PartitionAnnouncement,
    PartitionBlob,
    PrefillDone,
    RefitReply,
    RefitRequest,
    RequestFinished,
    RouterControl,
    RouterControlReply,
    SimStats,
    SimStatsRequest,
)

__all__ = [
    "ALL_MESSAGE_TYPES",
    "DEFAULT_MAX_BYTES",
    "KIND_OF",
    "SUPPORTED_VERSIONS",
    "AssembleReply",
    "AssembleRequest",
    "BlockSummaryBatch",
    "BlockSummaryMsg",
    "CaptureStatus",
    "DTypeName",
    "DeadLetter",
    "Decision",
    "DecodeJob",
    "DecodeJobAck",
    "DecodeJobDone",
    "DecodeProfile",
    "LoadReport",
    "Message",
    "NdArray",
    "PartitionAnnouncement",
    "PartitionBlob",
    "PrefillDone",
    "RefitReply",
    "RefitRequest",
    "RequestFinished",
    "RouterControl",
    "RouterControlReply",
    "SimStats",
    "SimStatsRequest",
    "SparseCounts",
    "WireError",
    "decode",
    "encode",
]
