"""`eldr deploy`: generate deployment configuration from the repository's sources of truth.

    eldr deploy nats-auth --namespace NS --user NAME=ROLE[:ID,...] ... [--format conf|helm]
        [--permissions FILE] [--out FILE]
    eldr deploy render OVERLAY_DIR [--out FILE]

`nats-auth` renders the users of a deployment with the per-role subject permissions of
deploy/nats/permissions.yaml: `conf` is a nats-server `authorization` block (the dev
overlay's auth.conf), `helm` values for the official NATS chart (deploy/nats/
values-auth.yaml). Passwords are never written: the server reads each from an environment
variable (`NATS_PW_<USER>`) filled from the user's Secret (`nats-<user>`, keys `user` and
`password`). The file's header records the command, so it can be made again.

`render` prints the manifests of a kustomize overlay as `kubectl kustomize` renders them
(kubectl ships kustomize; found on PATH).

`nats-auth` needs PyYAML (a development dependency).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "deploy",
        help="generate NATS auth configuration; render kustomize overlays",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="deploy_action", metavar="ACTION", required=True)

    auth = actions.add_parser("nats-auth", help="NATS users with per-role subject permissions")
    auth.add_argument("--namespace", default="eldr", help="ELDR namespace (default eldr)")
    auth.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NAME=ROLE[:ID,...]",
        help="a user: name, role of permissions.yaml and, for per-instance roles (decode, "
        "prefill, simdecode, simprefill), the worker ids it may publish for; repeatable",
    )
    auth.add_argument("--format", choices=("conf", "helm"), default="conf", dest="fmt")
    auth.add_argument("--permissions", type=Path, default=None, help="permissions file")
    auth.add_argument("--out", type=Path, default=None, help="write here (default stdout)")
    auth.set_defaults(func=_cmd_nats_auth)

    render = actions.add_parser("render", help="print a kustomize overlay's manifests")
    render.add_argument("overlay", type=Path, help="directory with a kustomization.yaml")
    render.add_argument("--out", type=Path, default=None, help="write here (default stdout)")
    render.set_defaults(func=_cmd_render)


def _write(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")


def _cmd_nats_auth(args: argparse.Namespace) -> int:
    from eldr.bus.permissions import (
        NatsUser,
        PermissionSpecError,
        load_permissions,
        render,
    )

    if not args.user:
        print("eldr deploy nats-auth: give at least one --user", file=sys.stderr)
        return 2
    try:
        users = [NatsUser.parse(text) for text in args.user]
        text = render(load_permissions(args.permissions), args.namespace, users, args.fmt)
    except (ValueError, PermissionSpecError, OSError) as exc:
        print(f"eldr deploy nats-auth: {exc}", file=sys.stderr)
        return 2
    _write(text, args.out)
    return 0


class KustomizeError(RuntimeError):
    """kubectl is missing, or `kubectl kustomize` refused the overlay."""


KUSTOMIZE_TIMEOUT_S = 120.0


def kustomize(overlay: Path) -> str:
    """The manifests of `overlay` as `kubectl kustomize` renders them (YAML documents)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KustomizeError("kubectl not found on PATH (`kubectl kustomize` renders overlays)")
    try:
        done = subprocess.run(
            [kubectl, "kustomize", str(overlay)],
            capture_output=True,
            text=True,
            timeout=KUSTOMIZE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KustomizeError(f"kubectl kustomize {overlay}: {exc}") from exc
    if done.returncode != 0:
        # kubectl's error is its last line (klog prefixes it with a timestamp and source)
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise KustomizeError(f"kubectl kustomize {overlay}: {lines[-1]}")
    return done.stdout


def _cmd_render(args: argparse.Namespace) -> int:
    try:
        text = kustomize(args.overlay)
    except KustomizeError as exc:
        print(f"eldr deploy render: {exc}", file=sys.stderr)
        return 2
    _write(text, args.out)
    return 0
