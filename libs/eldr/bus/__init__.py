"""The only module that talks to NATS: connect, topology, publish, serve, consume, drain.

Services use `Bus` (bus.py: the connection, publishing and commit, dead letters, the
receivers and the object store, one module each), the topology as data (topology.py) and
`apply_topology` (apply.py); they never import `nats`.
"""

from eldr.bus.apply import TopologyChange, apply_topology, delete_topology
from eldr.bus.bus import Bus
from eldr.bus.connection import is_reply_inbox
from eldr.bus.consumer import Consumer
from eldr.bus.delivery import Delivery, Handler, RequestHandler, Undecodable
from eldr.bus.errors import (
    REFUSAL_REASONS,
    AlreadyExists,
    BusError,
    BusTimeoutError,
    DisconnectedError,
    NoRespondersError,
    NotFoundError,
    Reject,
    RemoteError,
    Retry,
    TopologyError,
    UnavailableError,
)
from eldr.bus.hold import hold_while
from eldr.bus.objects import ObjectRef
from eldr.bus.publishing import Committed, ConsumerState, PublishAck, StreamState
from eldr.bus.readback import ReadBack
from eldr.bus.receivers import Service, Subscription
from eldr.bus.topology import (
    ROUTER_CONSUMER,
    SIGNATURE_QUEUE,
    ConsumerSpec,
    ObjectStoreSpec,
    StreamSpec,
    Subjects,
    Topology,
    build_topology,
    rid_token,
    stream_name,
)
from eldr.bus.transient import TRANSIENT_KINDS, Backoff, FaultLog, transient_kind

__all__ = [
    "REFUSAL_REASONS",
    "ROUTER_CONSUMER",
    "SIGNATURE_QUEUE",
    "TRANSIENT_KINDS",
    "AlreadyExists",
    "Backoff",
    "Bus",
    "BusError",
    "BusTimeoutError",
    "Committed",
    "Consumer",
    "ConsumerSpec",
    "ConsumerState",
    "Delivery",
    "DisconnectedError",
    "FaultLog",
    "Handler",
    "NoRespondersError",
    "NotFoundError",
    "ObjectRef",
    "ObjectStoreSpec",
    "PublishAck",
    "ReadBack",
    "Reject",
    "RemoteError",
    "RequestHandler",
    "Retry",
    "Service",
    "StreamSpec",
    "StreamState",
    "Subjects",
    "Subscription",
    "Topology",
    "TopologyChange",
    "TopologyError",
    "UnavailableError",
    "Undecodable",
    "apply_topology",
    "build_topology",
    "delete_topology",
    "hold_while",
    "is_reply_inbox",
    "rid_token",
    "stream_name",
    "transient_kind",
]
