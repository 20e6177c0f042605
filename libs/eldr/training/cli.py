"""`eldr refit`: ask the trainer service to fit and publish a new partition version now.

    eldr refit [--reason TEXT] [--k K] [--timeout SECONDS]

Sends a `RefitRequest` on `{ns}.trainer.refit` and prints the trainer's `RefitReply`.
NATS settings come from the environment (`ELDR_NATS_URL`, `ELDR_NAMESPACE`, ...). Exit
status: 0 when a version was published, 3 when the trainer skipped the refit (too few
requests, no live workers), 4 when it fitted a candidate but its shadow evaluation kept
the active version (with `ELDR_SHADOW_GATE_REQUESTS`; the message says why), 1 on an
error or when no trainer answered.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_SKIPPED = 3
EXIT_REJECTED = 4
DEFAULT_TIMEOUT_S = 300.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "refit",
        help="ask the trainer to refit and publish a partition version now",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reason", default="eldr refit", help="why (stored with the version)")
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="decode workers to give clusters to (default: every live worker)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the reply (default {DEFAULT_TIMEOUT_S:g}; a fit of a "
        "large window takes a while)",
    )
    p.set_defaults(func=_cmd_refit)


def _cmd_refit(args: argparse.Namespace) -> int:
    if args.k is not None and args.k < 1:
        print("eldr refit: --k must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    if args.timeout <= 0:
        print("eldr refit: --timeout must be positive", file=sys.stderr)
        return EXIT_ERROR
    from eldr.runtime import run_async

    return run_async(refit(args.reason, args.k, args.timeout))


async def refit(reason: str, k: int | None, timeout_s: float) -> int:
    """Send one RefitRequest; print the reply; return the exit status."""
    # Imported here so that building the `eldr` parser does not load the NATS client.
    from eldr.bus import Bus, BusError, BusTimeoutError, NoRespondersError
    from eldr.settings import BusSettings
    from eldr.wire import RefitReply, RefitRequest, WireError

    settings = BusSettings()
    subject = f"{settings.namespace}.trainer.refit"
    try:
        bus = await Bus.connect(settings, "eldr-refit")
    except (BusError, TimeoutError) as exc:
        print(f"eldr refit: cannot reach NATS at {settings.nats_url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        reply = await bus.request(
            bus.subjects.trainer_refit,
            RefitRequest(reason=reason, k=k),
            RefitReply,
            timeout_s=timeout_s,
        )
    except NoRespondersError:
        print(f"eldr refit: no trainer is serving {subject}", file=sys.stderr)
        return EXIT_ERROR
    except BusTimeoutError:
        print(f"eldr refit: no reply on {subject} within {timeout_s:g} s", file=sys.stderr)
        return EXIT_ERROR
    except (BusError, WireError) as exc:
        print(f"eldr refit: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        await bus.drain()
    version = "-" if reply.version is None else str(reply.version)
    print(f"status: {reply.status}\nversion: {version}\n{reply.message}")
    if reply.status == "ok":
        return EXIT_OK
    if reply.status == "rejected":
        return EXIT_REJECTED
    return EXIT_SKIPPED if reply.status == "skipped" else EXIT_ERROR
