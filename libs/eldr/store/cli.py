"""`eldr db`: migrate the database, check it against the models, list partition versions.

    eldr db upgrade [--url URL] [--revision REV]
    eldr db check [--url URL]          # exit 1 and list the differences if any
    eldr db versions [--model M] [--limit N] [--url URL]

The URL defaults to the settings (`ELDR_DATABASE_URL`, default `sqlite:///.eldr/eldr.db`).
SQLAlchemy and Alembic are imported when a command runs, not when `eldr` builds its parser.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def register(subparsers: Any) -> None:
    db = subparsers.add_parser("db", help="database: migrations and partition versions")
    actions = db.add_subparsers(dest="db_action", metavar="ACTION", required=True)

    upgrade = actions.add_parser("upgrade", help="migrate the database to a revision")
    _add_url(upgrade)
    upgrade.add_argument("--revision", default="head", help="target revision (default head)")
    upgrade.set_defaults(func=_cmd_upgrade)

    check = actions.add_parser(
        "check", help="compare the models with the migrated database; exit 1 on differences"
    )
    _add_url(check)
    check.set_defaults(func=_cmd_check)

    versions = actions.add_parser("versions", help="list partition versions, newest first")
    _add_url(versions)
    versions.add_argument("--model", default=None, help="only this model (default: all)")
    versions.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    versions.set_defaults(func=_cmd_versions)


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="SQLAlchemy database URL (default: ELDR_DATABASE_URL or sqlite:///.eldr/eldr.db)",
    )


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url)
    from eldr.store.settings import StoreSettings

    return StoreSettings().database_url


def _shown(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from eldr.store import migrate

    url = _url(args)
    migrate.upgrade(url, args.revision)
    print(f"{_shown(url)}: at revision {migrate.current_revision(url)}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from eldr.store import migrate

    # Alembic announces each autogenerate plugin at INFO; that is noise in a check's output.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    url = _url(args)
    problems = migrate.check(url)
    if not problems:
        print(f"{_shown(url)}: models and migrations agree (revision {migrate.head_revision()})")
        return 0
    print(f"{_shown(url)}: {len(problems)} difference(s) between models and database:")
    for problem in problems:
        print(f"  - {problem}")
    return 1


def _cmd_versions(args: argparse.Namespace) -> int:
    from sqlalchemy.pool import NullPool

    from eldr.store import migrate, repo

    url = _url(args)
    if migrate.current_revision(url) is None:
        print(f"{_shown(url)}: no schema yet; run `eldr db upgrade` first", file=sys.stderr)
        return 1
    engine = repo.make_engine(url, poolclass=NullPool)
    try:
        with repo.make_session_factory(engine)() as session:
            infos = repo.list_versions(session, args.model, args.limit)
    finally:
        engine.dispose()
    header = ("version", "model", "status", "created_at (UTC)", "k", "centroids", "dim", "n_train")
    rows = [header] + [
        (
            str(info.version),
            info.model,
            info.status.value,
            info.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            str(info.k),
            str(info.num_centroids),
            str(info.dim),
            str(info.n_train),
        )
        for info in infos
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row, info in zip(rows, [None, *infos], strict=True):
        line = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        if info is not None and (info.parent_version is not None or info.note):
            parent = f"parent={info.parent_version} " if info.parent_version is not None else ""
            line += f"  {parent}{info.note}"
        print(line.rstrip())
    if not infos:
        print("(no partition versions)")
    return 0
