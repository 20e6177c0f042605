"""`Bus`: the one NATS client of the project, put together from the concepts of its sibling
modules: the connection (`eldr.bus.connection`: connect, drain, the faults of a cluster),
publishing and commit (`eldr.bus.publishing`: publish, `commit_once`, request), dead
letters (`eldr.bus.deadletters`), the receivers (`eldr.bus.receivers`: serve, subscribe,
consume, read back, and their delivery contracts; the receive sequence they share in
`eldr.bus.delivery`, the durable pull consumer in `eldr.bus.consumer`, the ordered
read-back in `eldr.bus.readback`) and the object store (`eldr.bus.objects`)."""

from __future__ import annotations

from eldr.bus.objects import ObjectStore
from eldr.bus.receivers import Receiving


class Bus(Receiving, ObjectStore):
    """A connected NATS client with typed publish, request, serve and consume.

    Create with `await Bus.connect(settings, name)`; end with `await bus.drain()` (or use
    `async with`). Not thread-safe: use it from the event loop that connected it.
    """
