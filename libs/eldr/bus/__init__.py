"""The only module that talks to NATS: connect, topology, publish, serve, consume, drain.

Services use `Bus` (client.py), the topology as data (topology.py) and `apply_topology`
(apply.py); they never import `nats`.
"""

from eldr.bus.apply import TopologyChange, apply_topology, delete_topology
from eldr.bus.client import (
    Bus,
    Consumer,
    ConsumerState,
    Delivery,
    Handler,
    ObjectRef,
    PublishAck,
    Replay,
    RequestHandler,
    Service,
    StreamState,
    Subscription,
    Undecodable,
    is_reply_inbox,
)
from eldr.bus.errors import (
    AlreadyExists,
    BusError,
    BusTimeoutError,
    NoRespondersError,
    NotFoundError,
    RemoteError,
    Retry,
    TopologyError,
)
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

__all__ = [
    "ROUTER_CONSUMER",
    "SIGNATURE_QUEUE",
    "AlreadyExists",
    "Bus",
    "BusError",
    "BusTimeoutError",
    "Consumer",
    "ConsumerSpec",
    "ConsumerState",
    "Delivery",
    "Handler",
    "NoRespondersError",
    "NotFoundError",
    "ObjectRef",
    "ObjectStoreSpec",
    "PublishAck",
    "RemoteError",
    "Replay",
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
    "Undecodable",
    "apply_topology",
    "build_topology",
    "delete_topology",
    "is_reply_inbox",
    "rid_token",
    "stream_name",
]
