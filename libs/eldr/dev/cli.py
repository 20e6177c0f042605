"""`eldr dev up`: run the local stack in the foreground until Ctrl-C, restarting what
crashes (see eldr.dev.stack)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from eldr.bus.connection import redact_url
from eldr.dev.stack import (
    SERVICES,
    DevStackSettings,
    Stack,
    StackConfig,
    StackError,
    service_names,
)

log = logging.getLogger(__name__)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _replicas(text: str) -> tuple[str, int]:
    name, value = _key_value(text)
    if name not in service_names():
        raise argparse.ArgumentTypeError(
            f"unknown service {name!r} (known: {', '.join(service_names())})"
        )
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"replicas must be an integer, got {value!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError("replicas must be >= 0")
    return name, count


def config_from_args(args: argparse.Namespace, env: DevStackSettings) -> StackConfig:
    state_dir = Path(args.state_dir)
    return StackConfig(
        namespace=args.namespace or env.namespace,
        nats_url=args.nats_url or env.nats_url,
        nats_store_dir=state_dir / "nats",
        database_url=args.database_url or env.database_url,
        state_dir=state_dir,
        decoders=args.decoders,
        replicas=dict(args.replicas),
        skip_missing=args.skip_missing,
        env=dict(args.env),
        log_level=args.log_level_services,
        ready_timeout_s=args.ready_timeout,
        stop_timeout_s=args.stop_timeout,
        log_dir=state_dir / "logs",
    )


def up(args: argparse.Namespace) -> int:
    config = config_from_args(args, DevStackSettings())
    stack = Stack(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("got %s: stopping the stack", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            stack.start()
        except StackError as exc:
            log.error("%s", exc)
            return 1
        if stop.is_set():
            return 0
        started = ", ".join(p.instance_id for p in stack.processes)
        log.info(
            "stack up: NATS %s, namespace %s, database %s; services %s%s. Ctrl-C stops it.",
            redact_url(stack.nats_url or "-"),
            stack.namespace,
            make_url(stack.database_url).render_as_string(hide_password=True)
            if stack.database_url
            else "-",
            started,
            f" (not written yet: {', '.join(stack.skipped)})" if stack.skipped else "",
        )
        # Restarts crashed services and a dead nats-server; 1 = gave up (logged).
        return stack.supervise(stop)
    finally:
        codes = stack.stop()
        unclean = {k: v for k, v in codes.items() if v != 0}
        if unclean:
            log.warning("services that did not exit cleanly: %s", unclean)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def register(subparsers: Any) -> None:
    dev = subparsers.add_parser("dev", help="local development stack", description=__doc__)
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="COMMAND")
    p = dev_sub.add_parser(
        "up",
        help="start NATS, migrate the database, start every service and keep them running "
        "(crashed ones are restarted); Ctrl-C stops them",
        description="Start an embedded nats-server (unless --nats-url / ELDR_NATS_URL), "
        "migrate the database, and start "
        + ", ".join(f"{s.name} (x{s.replicas})" for s in SERVICES)
        + " in that order, each once the previous is ready; then restart any that exits (with "
        "backoff) and a dead nats-server, until Ctrl-C. The state directory is locked: a "
        "second stack on it is refused. The services die with this command, kill -9 "
        "included.",
    )
    p.add_argument("--namespace", help="subject/stream namespace (default: ELDR_NAMESPACE, eldr)")
    p.add_argument(
        "--nats-url", help="use this NATS server (default: ELDR_NATS_URL, else embedded)"
    )
    p.add_argument(
        "--database-url", help="partition database (default: ELDR_DATABASE_URL, else SQLite)"
    )
    p.add_argument("--state-dir", default=".eldr", help="SQLite, NATS store, logs (.eldr)")
    p.add_argument("--decoders", type=int, default=4, help="simulated decode workers (4)")
    p.add_argument(
        "--replicas",
        type=_replicas,
        action="append",
        default=[],
        metavar="SERVICE=N",
        help="processes of a service, repeatable (e.g. router=3, simprefill=1)",
    )
    p.add_argument(
        "--env",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of every service, repeatable (ELDR_SIMDECODE_TIME_SCALE=0.1)",
    )
    p.add_argument(
        "--skip-missing", action="store_true", help="start without services not written yet"
    )
    p.add_argument(
        "--service-log-level", dest="log_level_services", default="INFO", help="services' level"
    )
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds per service (60)")
    p.add_argument("--stop-timeout", type=float, default=15.0, help="seconds before SIGKILL (15)")
    p.set_defaults(func=up)
    dev.set_defaults(func=lambda _args: dev.print_help() or 2)
