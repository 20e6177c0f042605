"""deploy/nats/permissions.yaml: its structure, what each role may do (derived from the
subjects the services use), the files generated from it, and nats-server accepting them."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from eldr.bus.owners import BUCKET_OWNER, STREAM_OWNERS, owned_streams, unowned_streams
from eldr.bus.permissions import (
    NatsUser,
    Permissions,
    PermissionSpec,
    PermissionSpecError,
    command_of,
    inbox_prefix,
    load_permissions,
    parse_permissions,
    render,
    resolve,
    stream_names,
    subject_matches,
)
from eldr.bus.topology import Subjects, build_topology
from eldr.deploy import cli as deploy_cli
from eldr.dev.natsserver import find_nats_server
from eldr.settings import RetentionSettings

REPO = Path(__file__).resolve().parents[3]
DEV_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "dev"
GENERATED = (DEV_OVERLAY / "auth.conf", REPO / "deploy" / "nats" / "values-auth.yaml")
NS = "eldr"
S = Subjects(NS)
TOPOLOGY = build_topology(NS, RetentionSettings())
BUCKET = TOPOLOGY.partitions_bucket
SERVICE_ROLES = ("router", "signature", "trainer")


@pytest.fixture(scope="module")
def spec() -> PermissionSpec:
    return load_permissions()


def perms(spec: PermissionSpec, role: str, *ids: str) -> Permissions:
    return resolve(spec, role, NS, ids)


def everyone(spec: PermissionSpec) -> dict[str, Permissions]:
    return {
        role: perms(spec, role, *(("w0",) if spec.roles[role].per_instance else ()))
        for role in spec.roles
    }


# --- subject matching -------------------------------------------------------------------------

token = st.text(alphabet="abcdefgh0123_-", min_size=1, max_size=6)
subjects = st.lists(token, min_size=1, max_size=5).map(".".join)


@given(subjects)
def test_a_literal_pattern_matches_only_itself(subject: str) -> None:
    assert subject_matches(subject, subject)
    assert not subject_matches(subject, subject + ".x")
    assert not subject_matches(subject + ".x", subject)


@given(st.lists(token, min_size=1, max_size=5))
def test_star_matches_exactly_one_token(tokens: list[str]) -> None:
    for i in range(len(tokens)):
        pattern = ".".join([*tokens[:i], "*", *tokens[i + 1 :]])
        assert subject_matches(pattern, ".".join(tokens))
    assert not subject_matches(".".join([*tokens, "*"]), ".".join(tokens))


@given(st.lists(token, min_size=1, max_size=5), st.integers(min_value=0, max_value=4))
def test_gt_matches_one_or_more_trailing_tokens(tokens: list[str], cut: int) -> None:
    cut = min(cut, len(tokens) - 1)
    pattern = ".".join([*tokens[:cut], ">"])
    assert subject_matches(pattern, ".".join(tokens))
    assert not subject_matches(".".join([*tokens, ">"]), ".".join(tokens))


# --- the file ---------------------------------------------------------------------------------


def test_the_file_defines_a_role_per_service_and_worker_kind(spec: PermissionSpec) -> None:
    expected = {
        "router",
        "signature",
        "trainer",
        "operator",
        "decode",
        "decodeadapter",
        "prefill",
        "simdecode",
        "simprefill",
    }
    assert set(spec.roles) == expected
    assert all(role.description for role in spec.roles.values())
    assert {r for r, role in spec.roles.items() if role.per_instance} == {
        "decode",
        "decodeadapter",
        "prefill",
        "simdecode",
        "simprefill",
    }


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_services_may_create_every_stream_and_update_only_their_own(
    spec: PermissionSpec, role: str
) -> None:
    p = perms(spec, role)
    names = [s.name for s in TOPOLOGY.streams] + [TOPOLOGY.object_stores[0].stream_name]
    owned = owned_streams(TOPOLOGY, role)
    assert owned  # every service owns something
    for stream in names:
        for op in ("INFO", "CREATE"):
            assert p.allows("publish", f"$JS.API.STREAM.{op}.{stream}"), (role, op, stream)
        may_update = p.allows("publish", f"$JS.API.STREAM.UPDATE.{stream}")
        assert may_update == (stream in owned), (role, stream)
        assert not p.allows("publish", f"$JS.API.STREAM.DELETE.{stream}")
    creates_consumer = p.allows("publish", f"$JS.API.CONSUMER.CREATE.{NS.upper()}_PREFILL.router")
    assert creates_consumer == (role == "router")


def test_every_stream_has_one_owner_and_owners_are_roles(spec: PermissionSpec) -> None:
    assert unowned_streams(TOPOLOGY) == ()
    assert set(STREAM_OWNERS.values()) | {BUCKET_OWNER} <= set(SERVICE_ROLES)
    owners = [r for r in SERVICE_ROLES for _ in owned_streams(TOPOLOGY, r)]
    assert len(owners) == len(TOPOLOGY.streams) + len(TOPOLOGY.object_stores)


def test_each_role_uses_only_its_own_inbox_prefix(spec: PermissionSpec) -> None:
    for role, p in everyone(spec).items():
        own = inbox_prefix(NS, role, "w0" if spec.roles[role].per_instance else None)
        assert p.allows("subscribe", f"{own}.abc"), role
        assert p.allows("publish", f"{own}.abc"), role
        assert not p.allows("subscribe", "_INBOX.abc"), role
        for other in ("router", "signature", "trainer", "operator"):
            if other != role:
                assert not p.allows("subscribe", f"{inbox_prefix(NS, other)}.abc"), (role, other)
    several = perms(spec, "simdecode", "decode-0", "decode-1")
    for wid in ("decode-0", "decode-1"):
        assert several.allows("subscribe", f"{inbox_prefix(NS, 'simdecode', wid)}.abc")
    assert not perms(spec, "prefill", "pw1").allows(
        "subscribe", f"{inbox_prefix(NS, 'prefill', 'pw2')}.abc"
    )


def test_stream_placeholders_follow_the_topology() -> None:
    assert stream_names(NS) == tuple(s.name for s in TOPOLOGY.streams)


def test_workers_and_operators_only_read_the_topology(spec: PermissionSpec) -> None:
    for role in ("decode", "prefill", "operator"):
        p = perms(spec, role, "w0") if spec.roles[role].per_instance else perms(spec, role)
        for stream in stream_names(NS):
            assert p.allows("publish", f"$JS.API.STREAM.INFO.{stream}")
            assert not p.allows("publish", f"$JS.API.STREAM.CREATE.{stream}"), role


def test_router_permissions_cover_what_the_router_does(spec: PermissionSpec) -> None:
    p = perms(spec, "router")
    stream = NS.upper()
    requester = inbox_prefix(NS, "prefill", "pw0") + ".abc"
    for subject in (S.sig_assemble, S.decision("req-1"), requester):
        assert p.allows("publish", subject), subject
    assert not p.allows("publish", "_INBOX.abc.1")  # not any inbox: requesters' only
    for subject in (S.load("dw0"), S.decision("req-1"), S.control_router):
        assert p.allows("subscribe", subject), subject
    assert p.allows("publish", f"$JS.API.CONSUMER.MSG.NEXT.{stream}_PREFILL.router")
    assert p.allows("publish", f"$JS.ACK.{stream}_PREFILL.router.1.2.3.4.5")
    assert p.allows("publish", f"$JS.API.DIRECT.GET.{stream}_DECISIONS.{S.decision('req-1')}")
    assert p.allows("publish", f"$JS.API.STREAM.MSG.GET.OBJ_{BUCKET}")
    assert p.allows("publish", S.dlq(f"{stream}_PREFILL"))
    assert p.allow_responses


def test_trainer_permissions_cover_what_the_trainer_does(spec: PermissionSpec) -> None:
    p = perms(spec, "trainer")
    assert p.allows("publish", S.partition_active)
    assert p.allows("publish", f"$O.{BUCKET}.C.nuid123")
    assert p.allows("publish", f"$O.{BUCKET}.M.djE=")
    assert p.allows("publish", f"$JS.API.STREAM.PURGE.OBJ_{BUCKET}")
    for suffix in ("DECISIONS", "PROFILES", "LOAD"):
        assert p.allows("publish", f"$JS.API.CONSUMER.CREATE.{NS.upper()}_{suffix}")
    assert p.allows("subscribe", S.trainer_refit)


def test_only_routers_publish_decisions(spec: PermissionSpec) -> None:
    allowed = {r for r, p in everyone(spec).items() if p.allows("publish", S.decision("x"))}
    assert allowed == {"router"}


def test_only_the_trainer_and_operators_announce_partitions_and_write_blobs(
    spec: PermissionSpec,
) -> None:
    for subject in (S.partition_active, f"$O.{BUCKET}.C.x", f"$JS.API.STREAM.PURGE.OBJ_{BUCKET}"):
        allowed = {r for r, p in everyone(spec).items() if p.allows("publish", subject)}
        assert allowed == {"trainer", "operator"}, subject


def test_decode_workers_publish_only_their_own_load_and_profiles(spec: PermissionSpec) -> None:
    p = perms(spec, "decode", "dw7")
    assert p.allows("publish", S.load("dw7"))
    assert p.allows("publish", S.profiles("dw7"))
    for subject in (
        S.load("dw8"),
        S.profiles("dw8"),
        S.decision("x"),
        S.blocks("dw7"),
        S.prefill_done("dw7"),
        S.partition_active,
        S.trainer_refit,
    ):
        assert not p.allows("publish", subject), subject
    assert not p.allows("subscribe", S.decisions_all)


def test_prefill_workers_publish_only_their_own_blocks_and_events(spec: PermissionSpec) -> None:
    p = perms(spec, "prefill", "pw1")
    assert p.allows("publish", S.blocks("pw1"))
    assert p.allows("publish", S.prefill_done("pw1"))
    for subject in (S.blocks("pw2"), S.prefill_done("pw2"), S.load("pw1"), S.decision("x")):
        assert not p.allows("publish", subject), subject


def test_a_user_with_several_ids_gets_each(spec: PermissionSpec) -> None:
    p = perms(spec, "simdecode", "decode-0", "decode-1")
    for wid in ("decode-0", "decode-1"):
        assert p.allows("publish", S.load(wid))
        assert p.allows("subscribe", S.sim_decode(wid))
    assert not p.allows("publish", S.load("decode-2"))


def test_per_instance_roles_need_ids_and_others_refuse_them(spec: PermissionSpec) -> None:
    with pytest.raises(ValueError, match="per instance"):
        resolve(spec, "decode", NS)
    with pytest.raises(ValueError, match="not per instance"):
        resolve(spec, "router", NS, ["dw0"])
    with pytest.raises(ValueError, match="subject-safe"):
        resolve(spec, "decode", NS, ["dw.0"])


def test_subjects_follow_the_namespace(spec: PermissionSpec) -> None:
    p = resolve(spec, "router", "prod2")
    assert p.allows("publish", Subjects("prod2").decision("x"))
    assert not p.allows("publish", S.decision("x"))
    assert p.allows("publish", "$JS.API.STREAM.CREATE.PROD2_BLOCKS")


def minimal(**role: object) -> dict[str, object]:
    body = {"description": "d", **role}
    return {"version": 1, "grants": {"g": {"publish": ["a.b"]}}, "roles": {"r": body}}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"version": 2}, "version"),
        (minimal(publish=["{nope}.x"]), "unknown placeholders"),
        (minimal(publish=["{ns}.load.{id}"]), "not per_instance"),
        (minimal(include=["missing"]), "undefined grants"),
        (minimal(publish=["a.>.b"]), "last token"),
        (minimal(publish=["a.b*"]), "whole token"),
        (minimal(publish=["{stream}.{id}"], per_instance=True), "mixes"),
        (minimal(publish=["{inbox}.{owned}"]), "mixes"),
        (minimal(description=""), "description"),
        (minimal(colour="red"), "unknown keys"),
    ],
)
def test_malformed_files_are_refused(document: dict[str, object], message: str) -> None:
    with pytest.raises(PermissionSpecError, match=message):
        parse_permissions(document)


# --- generated files ----------------------------------------------------------------------------


def regenerate(path: Path, out: Path) -> str:
    parser = argparse.ArgumentParser()
    deploy_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["deploy", "nats-auth", *command_of(path.read_text()), "--out", str(out)]
    )
    assert args.func(args) == 0
    return out.read_text()


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_generated_files_are_up_to_date(path: Path, tmp_path: Path) -> None:
    assert regenerate(path, tmp_path / path.name) == path.read_text(), (
        f"{path} is stale: run the command in its header"
    )


def dev_users() -> list[NatsUser]:
    return [NatsUser.parse(a) for a in command_of(GENERATED[0].read_text()) if "=" in a]


def test_helm_values_take_every_password_from_its_secret(spec: PermissionSpec) -> None:
    values = yaml.safe_load(GENERATED[1].read_text())
    users = values["config"]["merge"]["authorization"]["users"]
    env = values["container"]["env"]
    for entry in users:
        user = NatsUser(entry["user"], "router")
        assert entry["password"] == f"<< ${user.password_env} >>"
        ref = env[user.password_env]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": user.secret_name, "key": "password"}


def test_the_dev_nats_server_accepts_the_generated_configuration(tmp_path: Path) -> None:
    for name in ("nats.conf", "auth.conf"):
        (tmp_path / name).write_text((DEV_OVERLAY / name).read_text())
    env = {**os.environ, **{u.password_env: "secret" for u in dev_users()}}
    result = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(tmp_path / "nats.conf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_records_the_command_that_makes_the_file(spec: PermissionSpec) -> None:
    users = [NatsUser("a", "router"), NatsUser("b", "decode", ("dw0", "dw1"))]
    text = render(spec, NS, users, "conf")
    args = command_of(text)
    assert args[args.index("--namespace") + 1] == NS
    assert [NatsUser.parse(a) for a in args if "=" in a] == users
