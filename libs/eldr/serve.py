"""`eldr serve SERVICE`: run one ELDR service process in the foreground.

Each service lives in `eldr_services.<name>.service` and exposes `main() -> int`, which
reads its settings from `ELDR_*` environment variables (see README, Configuration).
"""

from __future__ import annotations

import importlib
from typing import Any

SERVICES = (
    "signature",
    "router",
    "trainer",
    "simdecode",
    "simprefill",
    "gateway",
    "decodeadapter",
)


def run(name: str) -> int:
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r} (known: {', '.join(SERVICES)})")
    module = importlib.import_module(f"eldr_services.{name}.service")
    return int(module.main())


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run one service (settings from ELDR_* environment variables)",
        description=__doc__,
    )
    p.add_argument("service", choices=SERVICES)
    p.set_defaults(func=lambda args: run(args.service))
