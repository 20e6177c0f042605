"""Security against a real nats-server with mutual TLS, password and NKEY users and the
per-role permissions of `deploy/nats/permissions.yaml`:

- the services work with these credentials (a router commits decisions; a decode worker
  authenticated by NKEY reports its load; a prefill worker by password sends PrefillDone);
- a client without the rights cannot publish decisions, partition announcements or
  partition blobs, nor another worker's load reports;
- every role has an inbox prefix of its own: a decode worker can neither read the
  router's or a prefill worker's (gateway's) inbox nor write into it (issue 15, finding 6);
- a role may update only the streams it owns; a service applying a topology that differs
  from another role's stream reports it and leaves it alone (finding 12);
- a client that requires authentication refuses a NATS server without it (finding 12);
- wrong passwords, unknown NKEYs and clients without a certificate are refused;
- credentials given to a service (NATS password, NATS URL with user info, database URL
  with a password) never appear in its logs or its /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
from secure_nats import (
    SecureNats,
    User,
    missing_prerequisite,
    new_nkey_seed,
    start_secure_nats,
)

from eldr.bus import Bus, BusError, Delivery, apply_topology, build_topology
from eldr.bus.owners import owned_streams
from eldr.bus.permissions import inbox_prefix, load_permissions, resolve
from eldr.dev.natsserver import EmbeddedNats, free_port
from eldr.dev.stack import serve_command
from eldr.runtime import run_service
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    DeadLetter,
    Decision,
    LoadReport,
    PartitionAnnouncement,
    PrefillDone,
    RefitReply,
    RefitRequest,
    RouterControl,
    RouterControlReply,
)
from eldr_services.router.service import setup as router_setup
from eldr_services.router.settings import RouterSettings
from support import messages
from support.prereq import missing
from support.services import running_service

pytestmark = pytest.mark.integration

USERS = [
    User("router", "router"),
    User("signature", "signature"),
    User("trainer", "trainer", nkey=True),
    User("operator", "operator"),
    User("dw0", "decode", instances=("dw0",), nkey=True),
    User("pw0", "prefill", instances=("pw0",)),
    User("nobody", None),
    User("admin", "*"),
]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    absent = missing_prerequisite()
    if absent is not None:
        missing(*absent)
    namespace = f"s{uuid.uuid4().hex[:10]}"
    server = start_secure_nats(tmp_path_factory.mktemp("secure-nats"), namespace, USERS)
    try:
        yield server
    finally:
        server.server.stop()


def settings_for(secure: SecureNats, name: str, **overrides: object) -> BusSettings:
    creds = secure.users[name]
    fields: dict[str, object] = {
        "nats_url": secure.url,
        "namespace": secure.namespace,
        "inbox_prefix": creds.inbox_prefix,
        "tls_ca_file": secure.certs.ca,
        "tls_cert_file": secure.certs.client_cert,
        "tls_key_file": secure.certs.client_key,
        "startup_wait_s": 5.0,
        "reconnect_wait_s": 0.1,
        "request_timeout_s": 1.0,
        "fetch_timeout_s": 0.2,
    }
    if creds.password is not None:
        fields.update(user=name, password=creds.password)
    else:
        fields.update(nkeys_seed_file=creds.seed_file)
    fields.update(overrides)
    return BusSettings(**fields)  # type: ignore[arg-type]


RETENTION = RetentionSettings(
    **{f"{s}_max_bytes": 8 << 20 for s in ("blocks", "prefill", "decisions", "load", "dlq")},
    profiles_max_bytes=8 << 20,
    finished_max_bytes=8 << 20,
    partitions_max_bytes=16 << 20,
)


@asynccontextmanager
async def connected(secure: SecureNats, name: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(settings_for(secure, name), f"test-{name}")
    try:
        yield bus
    finally:
        await bus.drain()


async def topology(secure: SecureNats) -> None:
    """The router's rights include creating the topology (every service applies it)."""
    async with connected(secure, "router") as bus:
        await apply_topology(bus, build_topology(secure.namespace, RETENTION), role="router")


def done(rid: str, reply_to: str | None) -> PrefillDone:
    return PrefillDone(
        request_id=rid,
        model="m",
        prefill_worker="pw0",
        ts_s=time.time(),
        block_size=16,
        block_hashes=[],
        n_prompt_tokens=4,
        partial=None,
        num_moe_layers=2,
        num_experts=4,
        reply_to=reply_to,
    )


def load_report(worker: str, seq: int) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        incarnation="i",
        seq=seq,
        ts_s=time.time(),
        running=0,
        waiting=0,
        kv_tokens=0,
        kv_capacity_tokens=1000,
        admitted=[],
    )


async def test_services_work_with_mutual_tls_passwords_and_nkeys(secure: SecureNats) -> None:
    await topology(secure)
    router = RouterSettings(
        **settings_for(secure, "router").model_dump(),
        **RETENTION.model_dump(),
        policy="jsq",
        instance_id="router-sec",
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        run_service(
            "router",
            router,
            router_setup,
            stop=stop,
            ready=ready,
            install_signal_handlers=False,
            no_echo=True,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 20)
        async with connected(secure, "dw0") as worker, connected(secure, "pw0") as prefill:
            replies: asyncio.Queue[Decision] = asyncio.Queue()

            async def on_reply(decision: Decision, _: Delivery) -> None:
                await replies.put(decision)

            inbox = prefill.new_inbox()
            assert inbox.startswith(f"_INBOX.{secure.namespace}.prefill.pw0.")
            await prefill.subscribe(inbox, Decision, on_reply)
            for seq in range(3):
                await worker.publish(worker.subjects.load("dw0"), load_report("dw0", seq))
            await prefill.js_publish(
                prefill.subjects.prefill_done("pw0"), done("sec-1", inbox), msg_id="sec-1"
            )
            decision = await asyncio.wait_for(replies.get(), 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert decision.request_id == "sec-1"
    assert decision.worker_id == "dw0"


def _decision(rid: str) -> Decision:
    return messages.decision(rid, "dw0", router_id="forged")


@pytest.mark.parametrize("name", ["nobody", "dw0", "pw0"])
async def test_a_client_without_rights_cannot_publish_decisions_or_partitions(
    secure: SecureNats, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    await topology(secure)
    rid = f"forged-{name}"
    async with connected(secure, name) as intruder, connected(secure, "admin") as admin:
        subjects = intruder.subjects
        caplog.set_level(logging.WARNING, logger="eldr.bus")
        with pytest.raises(BusError):  # no ack: the server dropped the publish
            await intruder.js_publish(subjects.decision(rid), _decision(rid), timeout_s=1.0)
        await intruder.publish(subjects.decision(rid), _decision(rid))  # core: recorded if let in
        announcement = PartitionAnnouncement(
            version=99,
            model="m",
            object_name="v99",
            sha256="0" * 64,
            created_ts_s=time.time(),
            k=1,
            dim=1,
            workers=["dw0"],
        )
        with pytest.raises(BusError):
            await intruder.js_publish(subjects.partition_active, announcement, timeout_s=1.0)
        await intruder.publish(subjects.partition_active, announcement)
        with pytest.raises(BusError):
            await intruder.object_put(f"{secure.namespace}-partitions", "v99", announcement)
        await intruder.flush()
        stream = f"{secure.namespace.upper()}"
        assert await admin.get_last(f"{stream}_DECISIONS", subjects.decision(rid), Decision) is None
        assert (
            await admin.get_last(
                f"{stream}_PARTITIONS", subjects.partition_active, PartitionAnnouncement
            )
            is None
        )
    assert "permissions violation" in caplog.text.lower()  # the server said why


async def test_a_decode_worker_may_report_only_its_own_load(secure: SecureNats) -> None:
    await topology(secure)
    async with connected(secure, "dw0") as worker, connected(secure, "admin") as admin:
        await worker.publish(worker.subjects.load("dw0"), load_report("dw0", 1))
        await worker.publish(worker.subjects.load("dw1"), load_report("dw1", 1))
        await worker.flush()
        stream = f"{secure.namespace.upper()}_LOAD"
        own = await admin.get_last(stream, admin.subjects.load("dw0"), LoadReport)
        other = await admin.get_last(stream, admin.subjects.load("dw1"), LoadReport)
    assert own is not None
    assert other is None


async def _dead_letters(admin: Bus, ns: str, token: str) -> list[DeadLetter]:
    """The dead letters of `dlq.<token>` stored so far."""
    letters: list[DeadLetter] = []

    async def on(letter: DeadLetter, _: Delivery) -> None:
        letters.append(letter)

    reader = await admin.read_back(
        f"{ns.upper()}_DLQ", admin.subjects.dlq(token), DeadLetter, on, stop_at_end=True
    )
    await reader.wait_caught_up(timeout_s=10)
    return letters


async def test_a_worker_can_speak_only_for_itself(secure: SecureNats) -> None:
    """Identity from the transport (issue 15, finding 1). Decode user dw0 may publish only
    on load.dw0, but the body names the worker: its reports for a lighter worker "ghost"
    on its own subject were taken, and the router sent the next request to ghost. Now the
    router refuses them (identity_mismatch, dead-lettered) and decides for dw0; prefill
    user pw0's PrefillDone naming prefill worker pw1 on prefill.done.pw0 is dead-lettered
    and terminated instead of decided."""
    await topology(secure)
    ns = secure.namespace
    port = free_port()
    router = RouterSettings(
        **settings_for(secure, "router").model_dump(),
        **RETENTION.model_dump(),
        policy="jsq",
        instance_id="router-identity",
        metrics_port=port,
    )
    async with (
        connected(secure, "admin") as admin,
        running_service("router", router, router_setup),
        connected(secure, "dw0") as worker,
        connected(secure, "pw0") as prefill,
    ):
        replies: asyncio.Queue[Decision] = asyncio.Queue()

        async def on_reply(decision: Decision, _: Delivery) -> None:
            await replies.put(decision)

        inbox = prefill.new_inbox()
        await prefill.subscribe(inbox, Decision, on_reply)
        for seq in range(3):
            busy = msgspec.structs.replace(load_report("dw0", seq), running=5)
            await worker.publish(worker.subjects.load("dw0"), busy)
            # The ghost is idle: JSQ would pick it if the router believed the body.
            await worker.publish(worker.subjects.load("dw0"), load_report("ghost", seq))
        await worker.flush()
        forged_done = msgspec.structs.replace(done("id-forged", inbox), prefill_worker="pw1")
        await prefill.js_publish(
            prefill.subjects.prefill_done("pw0"), forged_done, msg_id="id-forged"
        )
        await prefill.js_publish(
            prefill.subjects.prefill_done("pw0"), done("id-1", inbox), msg_id="id-1"
        )
        decision = await asyncio.wait_for(replies.get(), 10)
        (view,) = await admin.request_many(
            admin.subjects.control_router, RouterControl(), RouterControlReply, timeout_s=2
        )
        refused = await _metric(
            port,
            'eldr_bus_messages_rejected_total{family="load",reason="identity_mismatch"}',
            at_least=3,
        )
        refused_done = await _metric(
            port,
            'eldr_bus_messages_rejected_total{family="prefill.done",reason="identity_mismatch"}',
            at_least=1,
        )
        core_letters = await _dead_letters(admin, ns, "core")
        prefill_letters = await _dead_letters(admin, ns, f"{ns.upper()}_PREFILL")
        forged_decision = await admin.get_last(
            f"{ns.upper()}_DECISIONS", admin.subjects.decision("id-forged"), Decision
        )
    assert (decision.request_id, decision.worker_id) == ("id-1", "dw0")
    assert [w for w, *_ in decision.fleet] == ["dw0"]
    assert isinstance(view, RouterControlReply)
    assert view.live_workers == 1
    assert refused == 3
    assert refused_done == 1
    assert forged_decision is None
    load_letters = [d for d in core_letters if d.subject == worker.subjects.load("dw0")]
    assert len(load_letters) == 3
    assert all("identity_mismatch" in d.error and "ghost" in d.error for d in load_letters)
    assert [d.stream_seq is not None and "pw1" in d.error for d in prefill_letters] == [True]
    print(
        f"\nidentity: 3 forged load reports and 1 forged PrefillDone refused and "
        f"dead-lettered; decision for {decision.worker_id}, live workers {view.live_workers}"
    )


async def _metric(port: int, series: str, *, at_least: float = 0.0) -> float:
    """The value of one series on /metrics, once it reaches `at_least` (or after 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        value = 0.0
        for line in text.splitlines():
            if line.startswith(series + " "):
                value = float(line.split()[-1])
        if value >= at_least or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "case", ["wrong_password", "unknown_nkey", "no_client_certificate", "no_tls"]
)
async def test_bad_credentials_are_refused(secure: SecureNats, case: str, tmp_path: Path) -> None:
    overrides: dict[str, object] = {"startup_wait_s": 2.0, "connect_timeout_s": 1.0}
    name = "router"
    if case == "wrong_password":
        overrides["password"] = "not-the-password"
    elif case == "unknown_nkey":
        seed, _ = new_nkey_seed()
        (tmp_path / "other.nk").write_text(seed)
        name = "dw0"
        overrides["nkeys_seed_file"] = tmp_path / "other.nk"
    elif case == "no_client_certificate":
        overrides.update(tls_cert_file=None, tls_key_file=None)
    else:
        overrides.update(
            nats_url=f"nats://127.0.0.1:{secure.server.port}",
            tls_ca_file=None,
            tls_cert_file=None,
            tls_key_file=None,
        )
    settings = settings_for(secure, name, **overrides)
    with pytest.raises((BusError, TimeoutError)):
        await Bus.connect(settings, f"bad-{case}")


# --- credentials stay out of logs and metrics ---------------------------------------------


def _spawn(name: str, env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        serve_command(name),
        env={**os.environ, **env, "ELDR_METRICS_PORT": str(port), "PYTHONUNBUFFERED": "1"},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError as exc:
        return f"({exc})"


async def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()  # noqa: ASYNC240 - a failure
        if '"ready": true' in _get(url):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} not ready:\n{log.read_text()[-3000:]}")  # noqa: ASYNC240


@pytest.mark.slow
async def test_credentials_never_appear_in_logs_or_metrics(
    secure: SecureNats, tmp_path: Path
) -> None:
    await topology(secure)
    nats_password = secure.users["router"].password
    assert nats_password is not None
    db_password = "db-" + uuid.uuid4().hex
    common = {
        "ELDR_NAMESPACE": secure.namespace,
        "ELDR_LOG_LEVEL": "DEBUG",
        "ELDR_TLS_CA_FILE": str(secure.certs.ca),
        "ELDR_TLS_CERT_FILE": str(secure.certs.client_cert),
        "ELDR_TLS_KEY_FILE": str(secure.certs.client_key),
        **{f"ELDR_{k.upper()}": str(v) for k, v in RETENTION.model_dump().items()},
    }
    # The router gets its password inside the URL; the trainer by NKEY and a database URL
    # with a password, on a port where nothing listens (every refit fails and says why).
    router_env = {
        **common,
        "ELDR_NATS_URL": f"tls://router:{nats_password}@127.0.0.1:{secure.server.port}",
        "ELDR_INSTANCE_ID": "router-secret",
        "ELDR_INBOX_PREFIX": secure.users["router"].inbox_prefix,
    }
    seed_file = secure.users["trainer"].seed_file
    assert seed_file is not None
    seed = seed_file.read_text().strip()
    trainer_env = {
        **common,
        "ELDR_NATS_URL": secure.url,
        "ELDR_NKEYS_SEED_FILE": str(seed_file),
        "ELDR_DATABASE_URL": f"postgresql+psycopg://eldr:{db_password}@127.0.0.1:{free_port()}/x",
        "ELDR_DATABASE_CONNECT_TIMEOUT_S": "1",
        "ELDR_TRAINER_WORKERS": "dw0",
        "ELDR_MIN_SAMPLES": "1",
        "ELDR_INSTANCE_ID": "trainer-secret",
        "ELDR_INBOX_PREFIX": secure.users["trainer"].inbox_prefix,
    }
    ports = {"router": free_port(), "trainer": free_port()}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    processes = {
        "router": _spawn("router", router_env, ports["router"], logs["router"]),
        "trainer": _spawn("trainer", trainer_env, ports["trainer"], logs["trainer"]),
    }
    scraped: list[str] = []
    try:
        for name, process in processes.items():
            await _wait_http(f"http://127.0.0.1:{ports[name]}/readyz", process, logs[name])
        async with connected(secure, "operator") as operator:
            # Answered (skipped: no requests); the database errors came at start.
            reply = await operator.request(
                operator.subjects.trainer_refit,
                RefitRequest(reason="secrets test"),
                RefitReply,
                timeout_s=30,
            )
        for name in ports:
            for path in ("metrics", "healthz", "readyz"):
                scraped.append(_get(f"http://127.0.0.1:{ports[name]}/{path}"))
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    output = "\n".join(log.read_text(errors="replace") for log in logs.values())
    everything = output + "\n".join(scraped) + reply.message
    for secret in (nats_password, db_password, seed):
        assert secret not in everything
    # The checks looked at the right text: the services ran, talked about their
    # connections and the database, and redacted what they showed.
    assert "nats client eldr-router-router-secret connected to tls://***@127.0.0.1" in output
    assert "eldr:***@127.0.0.1" in output
    assert "eldr_router_decisions_total" in "\n".join(scraped)


# --- inboxes: per role (finding 6) ---------------------------------------------------------


async def test_a_decode_worker_can_neither_read_nor_write_other_roles_inboxes(
    secure: SecureNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The router answers a prefill worker (or gateway, role prefill) on its inbox and
    receives its own replies on its inbox; decode worker dw0, subscribed to both roles'
    inboxes and to every inbox, sees none of it, and a decision it forges into the prefill
    worker's inbox does not arrive. Its own inbox still works (the control)."""
    await topology(secure)
    ns = secure.namespace
    caplog.set_level(logging.WARNING, logger="eldr.bus")
    async with (
        connected(secure, "router") as router,
        connected(secure, "pw0") as prefill,
        connected(secure, "dw0") as intruder,
    ):
        got: dict[str, list[str]] = {"prefill": [], "router": [], "intruder": [], "own": []}
        controls = {name: asyncio.Event() for name in ("prefill", "router", "own")}

        def collect(into: str) -> Callable[[Decision, Delivery], Awaitable[None]]:
            async def on(decision: Decision, delivery: Delivery) -> None:
                got[into].append(decision.request_id)
                if into in controls:
                    controls[into].set()

            return on

        prefill_inbox = prefill.new_inbox()
        router_inbox = router.new_inbox()
        own_inbox = intruder.new_inbox()
        assert router_inbox.startswith(f"_INBOX.{ns}.router.")
        assert own_inbox.startswith(f"_INBOX.{ns}.decode.dw0.")
        await prefill.subscribe(prefill_inbox, Decision, collect("prefill"))
        await router.subscribe(router_inbox, Decision, collect("router"))
        await intruder.subscribe(own_inbox, Decision, collect("own"))
        for pattern in (f"_INBOX.{ns}.router.>", f"_INBOX.{ns}.prefill.>", "_INBOX.>"):
            await intruder.subscribe(pattern, Decision, collect("intruder"))
        await intruder.flush()
        await intruder.publish(prefill_inbox, _decision("forged-into-prefill"))
        await intruder.publish(router_inbox, _decision("forged-into-router"))
        await intruder.publish(own_inbox, _decision("own"))
        await intruder.flush()
        await router.publish(prefill_inbox, _decision("from-router"))
        await router.publish(router_inbox, _decision("router-own"))
        await router.flush()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in controls.values())), 5)
        await asyncio.sleep(0.3)  # anything the intruder could get has arrived by now
    assert got["prefill"] == ["from-router"]
    assert got["router"] == ["router-own"]
    assert got["own"] == ["own"]
    assert got["intruder"] == []
    assert "permissions violation" in caplog.text.lower()


def test_only_the_router_may_answer_into_requester_inboxes() -> None:
    """The generated permissions: the router may publish into prefill and simprefill
    inboxes (PrefillDone.reply_to), no other role into any inbox but its own."""
    spec = load_permissions()
    ns = "eldr"
    prefill_reply = inbox_prefix(ns, "prefill", "pw0") + ".x"
    router = resolve(spec, "router", ns)
    assert router.allows("publish", prefill_reply)
    assert router.allows("publish", inbox_prefix(ns, "simprefill", "sp0") + ".x")
    assert not router.allows("publish", inbox_prefix(ns, "trainer") + ".x")
    others: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("decode", ("dw0",)),
        ("signature", ()),
        ("trainer", ()),
        ("prefill", ("p1",)),
    )
    for role, ids in others:
        perms = resolve(spec, role, ns, ids)
        own = inbox_prefix(ns, role, ids[0] if ids else None) + ".x"
        assert perms.allows("publish", own)
        assert perms.allows("subscribe", own)
        assert not perms.allows("publish", prefill_reply), role
        assert not perms.allows("subscribe", prefill_reply), role
        assert not perms.allows("subscribe", inbox_prefix(ns, "router") + ".x"), role
        assert not perms.allows("subscribe", "_INBOX.x"), role


# --- streams: each role updates only its own (finding 12) ---------------------------------


async def test_a_role_may_update_only_the_streams_it_owns(secure: SecureNats) -> None:
    await topology(secure)
    ns = secure.namespace
    changed = RetentionSettings(
        **{**RETENTION.model_dump(), "decisions_max_bytes": 4 << 20, "blocks_max_bytes": 4 << 20}
    )
    wanted = build_topology(ns, changed)
    async with connected(secure, "signature") as signature, connected(secure, "admin") as admin:
        # The signature service's own path: BLOCKS (its own) updated, DECISIONS reported.
        changes = {c.name: c for c in await apply_topology(signature, wanted, role="signature")}
        assert changes[f"{ns.upper()}_BLOCKS"].action == "updated"
        decisions = changes[f"{ns.upper()}_DECISIONS"]
        assert (decisions.action, decisions.detail) == ("differs", "max_bytes")
        # Forcing it (no role) is refused by the server: no permission, no answer.
        with pytest.raises(BusError):
            await apply_topology(signature, wanted)
        assert (await admin.stream_state(f"{ns.upper()}_BLOCKS")).size_bytes >= 0
        info = await admin._js.stream_info(f"{ns.upper()}_DECISIONS")
        assert info.config.max_bytes == RETENTION.decisions_max_bytes
        blocks = await admin._js.stream_info(f"{ns.upper()}_BLOCKS")
        assert blocks.config.max_bytes == 4 << 20
    async with connected(secure, "signature") as signature:  # put BLOCKS back
        await apply_topology(signature, build_topology(ns, RETENTION), role="signature")


def test_the_generated_permissions_give_stream_updates_to_owners_only() -> None:
    spec = load_permissions()
    topology = build_topology("eldr", RetentionSettings())
    for role in ("router", "signature", "trainer", "operator"):
        perms = resolve(spec, role, "eldr")
        for stream in [s.name for s in topology.streams] + ["OBJ_eldr-partitions"]:
            may = perms.allows("publish", f"$JS.API.STREAM.UPDATE.{stream}")
            assert may == (stream in owned_streams(topology, role)), (role, stream)


# --- production default: authentication required (finding 12) -----------------------------


async def test_a_client_requiring_auth_refuses_an_open_server(
    nats_server: EmbeddedNats, secure: SecureNats
) -> None:
    open_bus = BusSettings(nats_url=nats_server.url, require_auth=True, startup_wait_s=2.0)
    with pytest.raises(BusError, match="does not require authentication"):
        await Bus.connect(open_bus, "require-auth-open")
    async with connected(secure, "router") as bus:  # the secured one is accepted
        assert bus.is_connected
    bus = await Bus.connect(settings_for(secure, "router", require_auth=True), "require-auth")
    await bus.drain()
