"""Hostile MessagePack: random bytes, random documents, documents of the right kind with
random fields, and valid messages mutated (wrong types, huge arrays, negative ids, unknown
schema versions, unknown kinds, missing or extra fields, truncated or corrupted bytes).

The generators take a `Chooser`, so the same mutations run under hypothesis (`payloads`: a
strategy, shrinking included) and under a seeded `random.Random` (`RandomChooser`: about
fifty times cheaper per case, which is how every subject gets 10,000 cases in CI).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import msgspec
from hypothesis import strategies as st

from eldr.wire import KIND_OF, Message, encode

T = TypeVar("T")

SPECIAL_VALUES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    -(2**63),
    2**63,
    2**64 - 1,
    999,  # an unknown schema version where `v` is mutated
    -0.0,
    1e30,
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    "a.b.c",
    "*",
    ">",
    "_INBOX.x y",
    "x" * 300,
    "x" * 5000,
    b"",
    b"\x00" * 7,
    b"\xff" * 4096,
    [],
    [0] * 70_000,  # more block hashes than a request may have
    [-1] * 3,
    [[1, 2]] * 5000,  # more workers / scores than allowed
    ["w"] * 5000,
    {},
    {"": None},
    {"k" * 100: 1},
    {"shape": [4, 16], "idx": b"\x01\x00\x00\x00", "val": b"\x01\x00"},  # a SparseCounts
    {"shape": [-1, 16], "idx": b"", "val": b""},
    {"shape": [1 << 20, 1 << 20], "idx": b"", "val": b""},
    {"dtype": "uint32", "shape": [4, 16], "data": b"\x00" * 256},  # an NdArray
    {"dtype": "uint32", "shape": [1 << 30, 1 << 30], "data": b""},
    {"dtype": "object", "shape": [1], "data": b"\x00" * 8},
)
KINDS: tuple[Any, ...] = (*KIND_OF.values(), "nope", 7, None)
VERSIONS: tuple[Any, ...] = (0, -1, 2, 999, 2**64 - 1, "1", None)
OPS = ("replace", "special", "delete", "add", "kind", "version")
CORRUPTIONS = ("none", "none", "truncate", "flip", "append")


class Chooser(Protocol):
    def choice(self, options: Sequence[T]) -> T: ...
    def integer(self, lo: int, hi: int) -> int: ...
    def document(self) -> Any:
        """A random MessagePack-able value (scalars, lists, maps, nested)."""
        ...

    def binary(self, lo: int, hi: int) -> bytes: ...
    def text(self, lo: int, hi: int) -> str: ...


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def plain(message: Message) -> dict[str, Any]:
    """A message as plain MessagePack data (dicts, lists, bytes)."""
    document = msgspec.msgpack.decode(encode(message))
    assert isinstance(document, dict)
    return document


def _slots(document: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every (nested) dict key and list index of `document` (first 8 items of a list)."""
    found: list[tuple[Any, ...]] = []
    if isinstance(document, dict):
        for key, value in document.items():
            found.append((*path, key))
            found.extend(_slots(value, (*path, key)))
    elif isinstance(document, list):
        for index, value in enumerate(document[:8]):
            found.append((*path, index))
            found.extend(_slots(value, (*path, index)))
    return found


def _parent(document: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        document = document[step]
    return document


def mutate(c: Chooser, seeds: Sequence[dict[str, Any]]) -> bytes:
    """A valid seed with 1-3 structural edits, then possibly corrupted bytes."""
    document = copy.deepcopy(c.choice(seeds))
    for _ in range(c.integer(1, 3)):
        slots = _slots(document)
        if not slots:
            break
        path = c.choice(slots)
        parent = _parent(document, path)
        key = path[-1]
        op = c.choice(OPS)
        # Copies: a chosen value may be a shared object (SPECIAL_VALUES) that a later edit
        # of this document would otherwise change for every later case.
        if op == "replace":
            parent[key] = copy.deepcopy(c.document())
        elif op == "special":
            parent[key] = copy.deepcopy(c.choice(SPECIAL_VALUES))
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "add" and isinstance(parent, dict):
            parent[c.text(1, 12)] = copy.deepcopy(c.document())
        elif op == "kind":
            document["kind"] = c.choice(KINDS)
        elif op == "version":
            document["v"] = c.choice(VERSIONS)
    data = pack(document)
    corruption = c.choice(CORRUPTIONS)
    if corruption == "truncate" and data:
        data = data[: c.integer(0, len(data) - 1)]
    elif corruption == "flip" and data:
        at = c.integer(0, len(data) - 1)
        data = data[:at] + bytes([data[at] ^ c.integer(1, 255)]) + data[at + 1 :]
    elif corruption == "append":
        data += c.binary(1, 16)
    return data


def payload(c: Chooser, kind: str, seeds: Sequence[dict[str, Any]]) -> bytes:
    """One hostile payload for a subject of messages of `kind`."""
    shape = c.integer(0, 6)
    if shape == 0:
        return c.binary(0, 512)
    if shape == 1:
        return pack(c.document())
    if shape == 2:
        fields = {c.text(0, 12): c.document() for _ in range(c.integer(0, 8))}
        return pack({**fields, "kind": kind})
    if shape == 6:
        return pack(c.choice(seeds))  # valid as it is
    return mutate(c, seeds)


# --- a seeded chooser (fast) ----------------------------------------------------------------


class RandomChooser:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def binary(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))

    def text(self, lo: int, hi: int) -> str:
        alphabet = "abcxyz_-.*> \u00e9\u4e2d\x00"
        return "".join(self.choice(alphabet) for _ in range(self.rng.randint(lo, hi)))

    def _scalar(self) -> Any:
        pick = self.rng.randrange(8)
        if pick == 0:
            return None
        if pick == 1:
            return self.rng.random() < 0.5
        if pick == 2:
            return self.rng.randint(-(2**63), 2**64 - 1)
        if pick == 3:
            return self.rng.randint(-3, 300)
        if pick == 4:
            return self.rng.uniform(-1e9, 1e9)
        if pick == 5:
            return self.text(0, 24)
        if pick == 6:
            return self.binary(0, 64)
        return self.choice(SPECIAL_VALUES)

    def document(self, depth: int = 0) -> Any:
        pick = self.rng.randrange(6)
        if depth >= 3 or pick < 4:
            return self._scalar()
        if pick == 4:
            return [self.document(depth + 1) for _ in range(self.rng.randint(0, 6))]
        return {self.text(0, 12): self.document(depth + 1) for _ in range(self.rng.randint(0, 6))}


# --- hypothesis -----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=64),
    st.sampled_from(SPECIAL_VALUES),
)
documents = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=24,
)


class DrawChooser:
    """A `Chooser` drawing from hypothesis (so failures shrink)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def binary(self, lo: int, hi: int) -> bytes:
        return self.draw(st.binary(min_size=lo, max_size=hi))

    def text(self, lo: int, hi: int) -> str:
        return self.draw(st.text(min_size=lo, max_size=hi))

    def document(self) -> Any:
        return self.draw(documents)


def payloads(message_type: type[Message], seeds: Sequence[Message]) -> st.SearchStrategy[bytes]:
    """Hostile payloads for a subject whose messages are `message_type`."""
    kind = KIND_OF[message_type]
    plain_seeds = [plain(m) for m in seeds]

    @st.composite
    def one(draw: st.DrawFn) -> bytes:
        return payload(DrawChooser(draw), kind, plain_seeds)

    return one()
