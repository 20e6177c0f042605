"""Shared pieces of the wire schemas: the error type, size limits, constrained field types
and the `Message` base every top-level message derives from.

Limits bound what a decoder will accept from untrusted bytes; they are part of the wire
contract, so raising one is a (compatible) schema change and lowering one is not.

Constraints written as `msgspec.Meta` run in C on every decode (not on construction);
cross-field invariants live in `__post_init__`, which msgspec runs both on construction
and on decode, so a message that breaks one can neither be built nor received.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class WireError(ValueError):
    """A message could not be encoded or decoded, or broke a schema invariant."""


# --- limits (part of the wire contract) -------------------------------------------------

MAX_ID_LEN = 256
"""Longest request id, model name, router id or other identifier string."""
MAX_TEXT_LEN = 4096
"""Longest free-text field (error messages, reasons)."""
MAX_BLOCKS_PER_BATCH = 1024
MAX_BLOCKS_PER_REQUEST = 65_536
"""A 1M-token prompt at block size 16."""
MAX_MISSING_LISTED = 256
"""AssembleReply lists at most this many missing block hashes (the count is exact)."""
MAX_WORKERS = 4096
MAX_SCORES = 64
"""Top candidates recorded in a Decision."""
MAX_ADMITTED = 4096
MAX_ATTRS = 32
MAX_ATTR_VALUE_LEN = 1024
MAX_PARAMS = 64
MAX_METRICS = 256
MAX_HEADERS = 64
MAX_DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
MAX_NDARRAY_DIMS = 8
MAX_NDARRAY_ELEMENTS = 1 << 28
MAX_MOE_LAYERS = 4096
MAX_EXPERTS = 65_536
MAX_SPARSE_CELLS = 1 << 26
"""Upper bound on L * E of a SparseCounts matrix."""
MAX_BLOCK_SIZE = 1 << 16
MAX_WAIT_MS = 60_000
MAX_DURATION_S = 1e6
MAX_TS_S = 1e11
"""Unix seconds; about the year 5138. Also rejects inf and NaN."""
MAX_ABS_FLOAT = 1e30

TOKEN_PATTERN = r"^[A-Za-z0-9_-]+$"
"""A NATS-subject-safe token: worker ids appear as the last token of subjects."""
SHA256_HEX_PATTERN = r"^[0-9a-f]{64}$"

# --- constrained field types ------------------------------------------------------------

U64 = Annotated[int, msgspec.Meta(ge=0)]
"""Unsigned 64-bit integer. MessagePack cannot carry more than 2**64 - 1, and msgspec
refuses to encode it, so `ge=0` is the whole check."""
Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Version = Annotated[int, msgspec.Meta(ge=1)]
TimestampS = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TS_S)]
DurationS = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DURATION_S)]
FiniteFloat = Annotated[float, msgspec.Meta(ge=-MAX_ABS_FLOAT, le=MAX_ABS_FLOAT)]
"""Any finite float (the bounds reject NaN and +-inf)."""
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN, pattern=TOKEN_PATTERN)]
"""Worker ids and other names that become a subject token."""
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_LEN)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=SHA256_HEX_PATTERN)]
NumMoeLayers = Annotated[int, msgspec.Meta(ge=1, le=MAX_MOE_LAYERS)]
NumExperts = Annotated[int, msgspec.Meta(ge=1, le=MAX_EXPERTS)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
BlockHashes = Annotated[list[U64], msgspec.Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
WorkerList = Annotated[list[Token], msgspec.Meta(max_length=MAX_WORKERS)]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every top-level message.

    `kind` (the tag) names the type on the wire; `v` is the schema version of that type.
    Evolution is append-only: a new field gets a default and the type's `v` default goes
    up by one. Decoders refuse versions newer than the one they know (see
    `eldr.wire.codec.decode`), so consumers are upgraded before producers.
    """

    v: Version = 1


def require(condition: bool, message: str) -> None:
    """Raise WireError(message) unless `condition`; for `__post_init__` invariants."""
    if not condition:
        raise WireError(message)
