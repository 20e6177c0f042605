"""`eldr serve SERVICE`: run one ELDR service process in the foreground.

The services are found by entry point, not by name: each one registers
`<name> = "<module>:main"` in the `eldr.services` entry-point group (this project's
`pyproject.toml` registers the `eldr_services` shells), so the library never imports the
services' package. `main() -> int` reads the service's settings from `ELDR_*` environment
variables (see README, Configuration).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

ENTRY_POINT_GROUP = "eldr.services"


def services() -> dict[str, EntryPoint]:
    """The installed services by name (the `eldr.services` entry points)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def service_names() -> tuple[str, ...]:
    return tuple(sorted(services()))


def run(name: str) -> int:
    known = services()
    if name not in known:
        raise ValueError(
            f"unknown service {name!r} (known: {', '.join(sorted(known)) or 'none installed'})"
        )
    main: Callable[[], int] = known[name].load()
    return int(main())


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run one service (settings from ELDR_* environment variables)",
        description=__doc__,
    )
    p.add_argument("service", choices=service_names())
    p.set_defaults(func=lambda args: run(args.service))
