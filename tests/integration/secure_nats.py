"""A nats-server with TLS (mutual), password and NKEY users, and the per-role subject
permissions of `deploy/nats/permissions.yaml`, for the security tests.

Certificates come from the `openssl` command line (a CA, a server certificate for
127.0.0.1/localhost, a client certificate); NKEY pairs from the `nkeys` package (the same
package nats-py needs to authenticate with one). `missing_prerequisite()` says which is
missing.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from eldr.bus.permissions import inbox_prefix, load_permissions, resolve
from eldr.dev.natsserver import EmbeddedNats


def missing_prerequisite() -> tuple[str, str] | None:
    """(the switch that requires it, why) for what is missing, or None."""
    if shutil.which("openssl") is None:
        return (
            "ELDR_TEST_REQUIRE_OPENSSL",
            "the openssl command line is missing (needed to make test certificates; "
            "scripts/bootstrap-tools installs it)",
        )
    if importlib.util.find_spec("nkeys") is None:
        return (
            "ELDR_TEST_REQUIRE_NKEYS",
            "the nkeys package is missing (NKEY authentication needs it; make venv installs it)",
        )
    return None


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA and server / client certificates signed by it (RSA 2048, one day)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=eldr-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=eldr-test-{name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
            "-out", f"{name}.pem")  # fmt: skip
    return Certs(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )


def new_nkey_seed() -> tuple[str, str]:
    """A fresh user NKEY: (seed, public key)."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return seed.decode(), public


@dataclass(frozen=True)
class User:
    """A NATS user of the test server: `role` of permissions.yaml (None: no rights at all)."""

    name: str
    role: str | None
    """A role of permissions.yaml; None: no rights but its own inboxes; "*": every right
    (the tests' own reader)."""
    instances: tuple[str, ...] = ()
    nkey: bool = False

    def inbox_prefix(self, namespace: str) -> str:
        """The inbox prefix its clients connect with: its role's (`_INBOX` without one)."""
        if self.role is None or self.role == "*":
            return "_INBOX"
        return inbox_prefix(namespace, self.role, self.instances[0] if self.instances else None)


@dataclass
class Credentials:
    password: str | None = None
    seed_file: Path | None = None
    public_key: str | None = None
    inbox_prefix: str = "_INBOX"


@dataclass
class SecureNats:
    server: EmbeddedNats
    certs: Certs
    namespace: str
    users: dict[str, Credentials] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _permissions_block(role: str | None, namespace: str, instances: tuple[str, ...]) -> str:
    if role == "*":
        return ""
    if role is None:  # may connect and use its own inboxes, nothing else
        publish: tuple[str, ...] = ("_INBOX.>",)
        subscribe: tuple[str, ...] = ("_INBOX.>",)
        responses = False
    else:
        perms = resolve(load_permissions(), role, namespace, instances)
        publish, subscribe, responses = perms.publish, perms.subscribe, perms.allow_responses

    def rule(subjects: tuple[str, ...]) -> str:
        # An empty allow list is no restriction at all to nats-server: deny everything.
        if not subjects:
            return '{ deny: [">"] }'
        return f"{{ allow: [{', '.join(_quote(s) for s in subjects)}] }}"

    lines = ["permissions: {", f"  publish: {rule(publish)}", f"  subscribe: {rule(subscribe)}"]
    if responses:
        lines.append("  allow_responses: true")
    lines.append("}")
    return "\n        ".join(lines)


def start_secure_nats(directory: Path, namespace: str, users: list[User]) -> SecureNats:
    """Write certificates, credentials and the server configuration; start the server."""
    directory.mkdir(parents=True, exist_ok=True)
    certs = make_certs(directory)
    creds: dict[str, Credentials] = {}
    entries = []
    for user in users:
        block = _permissions_block(user.role, namespace, user.instances)
        if user.nkey:
            seed, public = new_nkey_seed()
            seed_file = directory / f"{user.name}.nk"
            seed_file.write_text(seed + "\n")
            seed_file.chmod(0o600)
            creds[user.name] = Credentials(
                seed_file=seed_file, public_key=public, inbox_prefix=user.inbox_prefix(namespace)
            )
            entries.append(f"{{ nkey: {_quote(public)}\n        {block} }}")
        else:
            password = secrets.token_urlsafe(24)
            creds[user.name] = Credentials(
                password=password, inbox_prefix=user.inbox_prefix(namespace)
            )
            entries.append(
                f"{{ user: {_quote(user.name)}, password: {_quote(password)}\n        {block} }}"
            )
    config = directory / "nats.conf"
    config.write_text(
        "tls {\n"
        f"  cert_file: {_quote(str(certs.server_cert))}\n"
        f"  key_file: {_quote(str(certs.server_key))}\n"
        f"  ca_file: {_quote(str(certs.ca))}\n"
        "  verify: true\n"  # mutual TLS: clients present a certificate signed by the CA
        "  timeout: 5\n"
        "}\n"
        "authorization {\n  users = [\n    " + "\n    ".join(entries) + "\n  ]\n}\n"
    )
    server = EmbeddedNats(config_file=config, store_dir=directory / "store")
    server.start()
    return SecureNats(server=server, certs=certs, namespace=namespace, users=creds)
