"""Encoding and validated decoding of wire messages.

`decode` is the one door for untrusted bytes: it refuses oversized input before parsing,
decodes against the tagged union of every known message type (so `kind` is required and
an unknown kind is named in the error), checks the type is one the caller expects and
that the schema version is not newer than this code knows, and turns every failure into
a `WireError` that says what was expected and what went wrong.
"""

from __future__ import annotations

from typing import Any, TypeVar, Union, overload

import msgspec

from eldr.wire.base import Message, WireError
from eldr.wire.messages import ALL_MESSAGE_TYPES, VIEWS

M = TypeVar("M", bound=Message)

DEFAULT_MAX_BYTES = 1 << 20
"""Default bound on an encoded message (NATS' default max_payload)."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[ALL_MESSAGE_TYPES]  # noqa: UP007
)


def _supported_version(message_type: type[Message]) -> int:
    for field in msgspec.structs.fields(message_type):
        if field.name == "v":
            return int(field.default)
    raise TypeError(f"{message_type.__name__} has no version field")


SUPPORTED_VERSIONS: dict[type[Message], int] = {t: _supported_version(t) for t in ALL_MESSAGE_TYPES}
"""Newest schema version of each type that this code can read (the default of its `v`)."""

for _view, _full in VIEWS.items():
    if _supported_version(_view) != SUPPORTED_VERSIONS[_full]:
        raise TypeError(
            f"view {_view.__name__} is at v{_supported_version(_view)}, {_full.__name__} "
            f"at v{SUPPORTED_VERSIONS[_full]}: keep them equal"
        )
    SUPPORTED_VERSIONS[_view] = SUPPORTED_VERSIONS[_full]

_VIEW_DECODERS: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {
    view: msgspec.msgpack.Decoder(view) for view in VIEWS
}
"""A view decodes the few fields it declares and skips the rest of the record unread
(msgspec ignores fields a struct does not declare)."""

KIND_OF: dict[type[Message], str] = {t: str(t.__struct_config__.tag) for t in ALL_MESSAGE_TYPES}
"""The `kind` tag of each message type."""


def encode(message: Message) -> bytes:
    """MessagePack bytes of `message` (its `kind` tag included)."""
    if type(message) in VIEWS:
        raise WireError(
            f"{type(message).__name__} is a view of {VIEWS[type(message)].__name__}: "
            "it is decoded, never sent"
        )
    try:
        return _ENCODER.encode(message)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode {type(message).__name__}: {exc}") from exc


@overload
def decode(data: bytes | bytearray | memoryview, expected: type[M], max_bytes: int = ...) -> M: ...
@overload
def decode(
    data: bytes | bytearray | memoryview,
    expected: tuple[type[Message], ...],
    max_bytes: int = ...,
) -> Message: ...
def decode(
    data: bytes | bytearray | memoryview,
    expected: type[Message] | tuple[type[Message], ...],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Message:
    """Decode and validate one message of the `expected` type(s) (or one view,
    `eldr.wire.messages.VIEWS`: the fields it declares of its full type).

    Raises WireError if `data` is longer than `max_bytes`, is not valid MessagePack, is
    not a known message kind, is a kind other than expected, breaks a field constraint or
    invariant, or has a schema version newer than this code supports.
    """
    expected_types = expected if isinstance(expected, tuple) else (expected,)
    wanted = " | ".join(t.__name__ for t in expected_types)
    size = len(data)
    if size > max_bytes:
        raise WireError(f"expected {wanted}: message of {size} bytes exceeds {max_bytes}")
    view = _VIEW_DECODERS.get(expected) if isinstance(expected, type) else None
    try:
        message = _DECODER.decode(data) if view is None else view.decode(data)
    except msgspec.ValidationError as exc:
        raise WireError(f"expected {wanted}: invalid message: {_explain(exc)}") from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"expected {wanted}: malformed MessagePack: {exc}") from exc
    if not isinstance(message, expected_types):
        raise WireError(f"expected {wanted}, got {type(message).__name__}")
    newest = SUPPORTED_VERSIONS[type(message)]
    if message.v > newest:
        raise WireError(
            f"{type(message).__name__} schema version {message.v} is newer than the "
            f"supported version {newest}: upgrade this consumer"
        )
    return message


def _explain(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if text.startswith("Invalid value") and text.endswith("at `$.kind`"):
        return f"unknown message kind ({text})"
    return text
