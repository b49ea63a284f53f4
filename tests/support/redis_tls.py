"""A real `redis-server` speaking TLS only, with ACL users, for tests and bench/redis_tls.py.

    files = make_tls_files(tmp_dir)          a CA, Redis's cert (127.0.0.1 / localhost), a client
                                             cert, and a second CA that signed none of them
    with tls_redis(files) as server:         --port 0 --tls-port <free>, tls-auth-clients yes
        connect_redis(server.url, 1.0, security=server.security("chatstore"))

The users come from deploy/redis-users.acl.template (what docs/security.md tells operators to
install), its password placeholders filled in, so the tests check the ACL operators run:
`default` is off, `chatstore` may touch `chatstore:*` keys only, `admin` may do anything (the
tests' own inspection). Debian's redis-server is built with TLS (`--tls-port`); without
redis-server the caller skips.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chatstore.redis_security import RedisSecurity
from tests.support.redis_server import LocalRedis, redis_server_binary

ACL_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "redis-users.acl.template"
PASSWORDS = {"chatstore": "chatstore-test-password", "admin": "admin-test-password"}


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: a client trusting it must refuse Redis


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, and what OpenSSL 3 prefers


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], common_name: str, server: bool
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_tls_files(directory: Path) -> TLSFiles:
    """A CA, Redis's certificate for 127.0.0.1 and localhost, a client certificate (both signed
    by the CA), and an unrelated CA; PEM files under directory, mode 0600."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca("chatstore test CA")
    other_cert, _ = _ca("some other CA")
    server_cert, server_key = _leaf(ca, "redis.test", server=True)
    client_cert, client_key = _leaf(ca, "chatstore", server=False)
    pem = serialization.Encoding.PEM
    return TLSFiles(
        ca=_write(directory / "ca.pem", ca[0].public_bytes(pem)),
        server_cert=_write(directory / "redis.pem", server_cert.public_bytes(pem)),
        server_key=_write(directory / "redis.key", _pem_key(server_key)),
        client_cert=_write(directory / "client.pem", client_cert.public_bytes(pem)),
        client_key=_write(directory / "client.key", _pem_key(client_key)),
        other_ca=_write(directory / "other-ca.pem", other_cert.public_bytes(pem)),
    )


def render_acl(passwords: dict[str, str]) -> str:
    """deploy/redis-users.acl.template, each `<sha256 of NAME's password>` filled in."""
    text = ACL_TEMPLATE.read_text()
    for user, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        text = text.replace(f"<sha256 of {user}'s password>", digest)
    users = [line for line in text.splitlines() if line.startswith("user ")]
    if any("<sha256 of" in line for line in users):
        raise ValueError("deploy/redis-users.acl.template names a user without a password here")
    return text


@dataclass
class TLSRedis(LocalRedis):
    """A LocalRedis (its stop()) that speaks TLS only, with the ACL users of PASSWORDS."""

    files: TLSFiles

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def security(self, user: str = "chatstore", ca: Path | None = None) -> RedisSecurity:
        """What a client needs: the CA (`ca` instead, e.g. the wrong one), the client
        certificate, and user's ACL credentials."""
        return RedisSecurity(
            ca_file=str(ca or self.files.ca),
            cert_file=str(self.files.client_cert),
            key_file=str(self.files.client_key),
            username=user,
            password=PASSWORDS[user],
        )

    def admin_client(self):
        """A client as the ACL's admin user: for the tests' own inspection (ACL LOG, KEYS)."""
        from chatstore.store.tiers.redis import connect_redis

        return connect_redis(self.url, 5.0, security=self.security("admin"))


def free_port(below: int = 65536) -> int:
    """A free loopback port under `below` (a cluster node's bus port is its port + 10000)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


def start_tls_redis(files: TLSFiles, cluster: bool = False, timeout_s: float = 15.0) -> TLSRedis:
    """redis-server on 127.0.0.1:<free port>, TLS only (no plain port), client certificates
    required, the users of deploy/redis-users.acl.template; returns once the admin user's PING
    answers. cluster: a one-node Redis Cluster (its bus over TLS too) holding every slot."""
    binary = redis_server_binary()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed")
    directory = files.ca.parent
    acl = directory / "users.acl"
    _write(acl, render_acl(PASSWORDS).encode())
    port = free_port(55536 if cluster else 65536)
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key),
        "--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "yes",
        "--aclfile", str(acl), "--dir", str(directory), "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    if cluster:
        args += [
            "--cluster-enabled", "yes", "--tls-cluster", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
        ]  # fmt: skip
    log = (directory / f"redis-{port}.log").open("wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    server = TLSRedis(port, process, files)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if server.admin_client().ping():
                break
        except Exception as exc:  # not up yet: refused, or TLS not ready
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"TLS redis-server did not start ({exc}); see {log.name}"
                ) from exc
            time.sleep(0.05)
    if cluster:
        _assign_all_slots(server, deadline)
    return server


def _assign_all_slots(server: TLSRedis, deadline: float) -> None:
    import redis

    client = redis.Redis(
        port=server.port, ssl=True, **server.security("admin").client_kwargs(server.url)
    )
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("the one-node TLS Redis Cluster did not reach cluster_state:ok")
        time.sleep(0.05)
    client.close()


@contextmanager
def tls_redis(files: TLSFiles) -> Iterator[TLSRedis]:
    server = start_tls_redis(files)
    try:
        yield server
    finally:
        server.stop()
