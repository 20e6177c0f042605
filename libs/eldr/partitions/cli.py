"""`eldr partitions activate VERSION`: make a stored partition version the active one and
announce it to the routers (roll back, or roll forward to a version retired earlier).

    eldr partitions activate VERSION [--note TEXT] [--url URL] [--timeout SECONDS]

Versions are immutable; activation only moves statuses (`eldr.store.repo.activate`: the
current active version of the model is retired, a retired one may be activated again, a
rejected one may not). The order is the trainer's: first the database (under the trainer's
write lock, so it does not interleave with a refit's write), then the blob the row stores,
checked against the SHA-256 the row holds, is put in the object store as `v{VERSION}`,
byte for byte, then a `PartitionAnnouncement` goes to `{ns}.partition.active`. Routers take
the newest announcement, whatever its version number, so they swap to it within a second.
Nothing is announced that is not committed; if the announcement fails the command says so
and exits 1, and running it again is safe.

A running trainer keeps refitting: its next refit is aligned to the activated version and
replaces it. To stay on a version, turn scheduled refits off first (ELDR_REFIT_INTERVAL_S=0,
docs/DEPLOY.md, "Rolling back").

Database URL: --url, else ELDR_DATABASE_URL; NATS: ELDR_NATS_URL, ELDR_NAMESPACE, ELDR_USER...
Exit status: 0 activated and announced; 1 failed (nothing changed, or stored but not
announced, as printed); 2 bad arguments or unknown version.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from eldr.bus import Bus, PublishAck
    from eldr.partitions.writer import StoredVersion

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class ActivationError(RuntimeError):
    """The version cannot be activated as asked (unknown, rejected, corrupt)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "partitions",
        help="activate a stored partition version (rollback) and announce it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="partitions_action", metavar="ACTION", required=True)
    activate = actions.add_parser(
        "activate", help="make VERSION the active version of its model and announce it"
    )
    activate.add_argument("version", type=int, help="partition version (see `eldr db versions`)")
    activate.add_argument("--note", default=None, help="stored with the version (why)")
    activate.add_argument("--url", default=None, help="database URL (default ELDR_DATABASE_URL)")
    activate.add_argument(
        "--timeout", type=float, default=30.0, help="seconds for the lock and NATS (default 30)"
    )
    activate.set_defaults(func=_cmd_activate)


def activate_version(
    sessions: sessionmaker[Session], version: int, *, note: str | None, lock_timeout_s: float
) -> StoredVersion:
    """Activate `version` in the database and return it with the blob that belongs to it."""
    from eldr.partitions.writer import stored_version, take_write_lock
    from eldr.store import repo

    try:
        with sessions.begin() as session:
            take_write_lock(session, lock_timeout_s)
            # Read and check before changing anything: a version whose stored blob does not
            # hash as its row says would be refused by every router.
            try:
                record = repo.get(session, version)
            except repo.CorruptVersionError as exc:
                raise ActivationError(f"{exc}; not activating it") from exc
            stored = stored_version(record)
            retired = repo.activate(session, version, note=note)
    except (repo.VersionNotFoundError, repo.InvalidTransitionError) as exc:
        raise ActivationError(str(exc)) from exc
    return dataclasses.replace(stored, retired=retired)


async def announce(bus: Bus, activated: StoredVersion, *, timeout_s: float) -> PublishAck:
    """Put the blob in the bucket and announce it (a new announcement even if this version
    was announced before: routers follow the newest one)."""
    from eldr.bus import build_topology
    from eldr.partitions.announce import announce_version
    from eldr.settings import RetentionSettings

    topology = build_topology(bus.settings.namespace, RetentionSettings())
    return await announce_version(
        bus,
        activated,
        bucket=topology.partitions_bucket,
        subject=bus.subjects.partition_active,
        created_ts_s=time.time(),
        # Unique: the trainer's `partition-v{N}` id would make the server drop a
        # re-announcement within the duplicate window.
        msg_id=f"partition-v{activated.version}-activate-{uuid.uuid4().hex}",
        timeout_s=timeout_s,
    )


def _cmd_activate(args: argparse.Namespace) -> int:
    if args.version < 1 or args.timeout <= 0:
        print("eldr partitions activate: VERSION >= 1 and --timeout > 0", file=sys.stderr)
        return EXIT_USAGE
    from sqlalchemy import make_url
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from eldr.partitions.writer import WriteLockTimeoutError
    from eldr.store import repo
    from eldr.store.settings import StoreSettings

    url = args.url or StoreSettings().database_url
    shown = make_url(url).render_as_string(hide_password=True)
    engine = repo.make_engine(url, poolclass=NullPool)
    try:
        activated = activate_version(
            repo.make_session_factory(engine),
            args.version,
            note=args.note,
            lock_timeout_s=args.timeout,
        )
    except ActivationError as exc:
        print(f"eldr partitions activate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SQLAlchemyError, WriteLockTimeoutError) as exc:
        lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        detail = lines[0] if lines else type(exc).__name__
        print(f"eldr partitions activate: database {shown}: {detail}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        engine.dispose()
    retired = "nothing" if activated.retired is None else f"version {activated.retired}"
    print(f"version {activated.version} ({activated.model}) is active; retired {retired}")
    from eldr.runtime import run_async

    return run_async(_announce_cli(activated, args.timeout))


async def _announce_cli(activated: StoredVersion, timeout_s: float) -> int:
    from eldr.bus import Bus, BusError
    from eldr.partitions.announce import BlobMismatchError
    from eldr.settings import BusSettings

    settings = BusSettings()
    try:
        bus = await Bus.connect(settings, "eldr-partitions")
    except (BusError, TimeoutError) as exc:
        print(
            f"eldr partitions activate: stored but NOT announced: cannot reach NATS at "
            f"{settings.nats_url}: {exc}; run the command again",
            file=sys.stderr,
        )
        return EXIT_FAILED
    try:
        ack = await announce(bus, activated, timeout_s=timeout_s)
    except (BusError, BlobMismatchError) as exc:
        print(
            f"eldr partitions activate: stored but NOT announced: {exc}; run the command again",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        await bus.drain()
    print(f"announced on {bus.subjects.partition_active} (stream sequence {ack.seq})")
    return EXIT_OK
