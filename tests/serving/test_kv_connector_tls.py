"""TLS on the tcp KV connector (issue 23): context and generation engines on loopback with real
certificates (a test CA made with `cryptography`), the stdlib `ssl` on both sides.

A handoff through TLS gives exactly the co-located tokens; a plain-TCP client, a client without
the required certificate (mutual TLS), a server whose certificate another CA signed or that names
another host are each refused with a clear error, and no KV block is left held on either side.
Impossible configurations fail at load, naming the setting."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.serving.test_disaggregated_engine import PROMPTS, _drain, _tokens, engine_dir  # noqa: F401 - fixture
from tests.serving.test_kv_handoff_security import PARAMS, _handoff, _take, colocated, key_file  # noqa: F401
from trtforge.config.runtime import RuntimeConfig
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


class _CA:
    """A certificate authority that signs leaf certificates for names (DNS) and addresses (IP)."""

    def __init__(self, directory: Path, name: str):
        self.dir, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.file = _write_cert(self.cert, directory / f"{name}.pem")

    def leaf(self, cn: str, hosts: list[str]) -> tuple[str, str]:
        """(certificate file, key file) of a leaf certificate for `hosts`."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = f"{self.name}-{cn}"
        return _write_cert(cert, self.dir / f"{stem}.pem"), _write_key(key, self.dir / f"{stem}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = _CA(directory, "ca"), _CA(directory, "rogue")
    return {"ca": ca.file, "server": ca.leaf("context", ["127.0.0.1", "localhost"]),
            "client": ca.leaf("generation", []), "other_host": ca.leaf("elsewhere", ["10.9.8.7"]),
            "rogue_ca": rogue.file, "rogue_server": rogue.leaf("context", ["127.0.0.1"])}


def _context(engine_dir, key_file, server, ca=None, timeout_s=30.0):  # noqa: F811
    return LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        phase="context", kv_connector="tcp://127.0.0.1:0", kv_auth_key_file=key_file,
        kv_tls_cert_file=server[0], kv_tls_key_file=server[1], kv_tls_ca_file=ca,
        handoff_timeout_s=timeout_s))


def _generation(engine_dir, key_file, ca, client=(None, None)):  # noqa: F811
    return LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        phase="generation", kv_peers="127.0.0.1", kv_auth_key_file=key_file, kv_tls_ca_file=ca,
        kv_tls_cert_file=client[0], kv_tls_key_file=client[1]))


def _run(gen: LLMEngine, handle) -> list:
    rid = gen.add_handoff(handle, PARAMS)
    return [o for o in _drain(gen) if o.request_id == rid]


def _until(condition, wait_s: float = 5.0) -> None:
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def _held_until_freed(ctx: LLMEngine, wait_s: float) -> None:
    """The context side frees a handoff nobody took within its deadline."""
    def freed():
        ctx.poll()
        return ctx.stats().kv_handoff_blocks_held == 0
    _until(freed, wait_s)
    assert ctx.stats().kv_blocks_used == 0


def test_a_handoff_through_tls_gives_the_colocated_tokens_and_plain_tcp_is_refused(
        engine_dir, key_file, pki, colocated):  # noqa: F811
    ctx = _context(engine_dir, key_file, pki["server"])
    gen = _generation(engine_dir, key_file, pki["ca"])
    try:
        handle = _handoff(ctx, PROMPTS[2])
        # A plain-TCP client naming the handle's every field gets no answer and no KV: the server
        # expects a TLS ClientHello, and closes the connection (at most a TLS alert comes back).
        with socket.create_connection(ctx.connector.address, timeout=5) as conn:
            conn.sendall(_take(handle))
            reply = b""
            try:
                while chunk := conn.recv(4096):
                    reply += chunk
            except ConnectionResetError:
                pass
        assert len(reply) < 16 and b"ok" not in reply, reply
        _until(lambda: ctx.connector.tls_failures == 1)  # counted by the server's thread after the close
        outs = _run(gen, handle)
        assert outs[-1].finish_reason == "length" and _tokens(outs) == colocated[PROMPTS[2]][1:]
        assert gen.connector.stats().handoffs == 1
        ctx.poll()
        assert ctx.stats().kv_handoff_blocks_held == 0 and gen.stats().kv_blocks_used == 0
    finally:
        ctx.close()


@pytest.mark.parametrize("server,why", [("rogue_server", "certificate verify failed"),
                                        ("other_host", "IP address mismatch")],
                         ids=["another-CA", "another-host"])
def test_a_server_the_ca_did_not_sign_for_this_host_is_refused(engine_dir, key_file, pki, server, why):  # noqa: F811
    ctx = _context(engine_dir, key_file, pki[server], timeout_s=1.0)
    gen = _generation(engine_dir, key_file, pki["ca"])
    try:
        outs = _run(gen, _handoff(ctx, PROMPTS[0]))
        assert outs[-1].finish_reason == "error" and "TLS handshake" in outs[-1].error
        assert why in outs[-1].error and "kv_tls_ca_file" in outs[-1].error
        assert gen.stats().kv_blocks_used == 0
        _held_until_freed(ctx, 5.0)  # nobody took it: freed at its deadline
    finally:
        ctx.close()


def test_mutual_tls_requires_the_client_certificate(engine_dir, key_file, pki, colocated):  # noqa: F811
    ctx = _context(engine_dir, key_file, pki["server"], ca=pki["ca"], timeout_s=1.0)
    anonymous = _generation(engine_dir, key_file, pki["ca"])
    signed = _generation(engine_dir, key_file, pki["ca"], client=pki["client"])
    try:
        outs = _run(anonymous, _handoff(ctx, PROMPTS[1]))
        assert outs[-1].finish_reason == "error" and "TLS" in outs[-1].error
        assert anonymous.stats().kv_blocks_used == 0
        _held_until_freed(ctx, 5.0)
        assert ctx.connector.tls_failures >= 1
        outs = _run(signed, _handoff(ctx, PROMPTS[2]))
        assert outs[-1].finish_reason == "length" and _tokens(outs) == colocated[PROMPTS[2]][1:]
        ctx.poll()
        assert ctx.stats().kv_handoff_blocks_held == 0 and signed.stats().kv_blocks_used == 0
    finally:
        ctx.close()


def test_impossible_tls_settings_fail_at_load(engine_dir, key_file, pki, tmp_path):  # noqa: F811
    cert, key = pki["server"]
    loose = tmp_path / "loose.key"
    loose.write_bytes(Path(key).read_bytes())
    loose.chmod(0o644)
    other_key = pki["client"][1]
    context_cases = [
        (dict(kv_tls_cert_file=cert), "needs kv_tls_key_file"),
        (dict(kv_tls_cert_file=cert, kv_tls_key_file=str(loose)), "chmod 600"),
        (dict(kv_tls_cert_file=cert, kv_tls_key_file=other_key), "the key must belong to the certificate"),
        (dict(kv_tls_cert_file=str(tmp_path / "missing.pem"), kv_tls_key_file=key), "cannot be read"),
        (dict(kv_tls_ca_file=pki["ca"]), "need kv_tls_cert_file"),
        (dict(kv_tls_cert_file=cert, kv_tls_key_file=key, kv_tls_ca_file=key), "kv_tls_ca_file"),
    ]
    for fields, message in context_cases:
        with pytest.raises(ValueError, match=message):
            LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
                phase="context", kv_connector="tcp://127.0.0.1:0", kv_auth_key_file=key_file, **fields))
    with pytest.raises(ValueError, match="shared memory"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", kv_tls_cert_file=cert,
                                                            kv_tls_key_file=key))
    with pytest.raises(ValueError, match="need kv_tls_ca_file"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
            phase="generation", kv_peers="127.0.0.1", kv_auth_key_file=key_file, kv_tls_cert_file=cert,
            kv_tls_key_file=key))
    with pytest.raises(ValueError, match="no kv_peers"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation", kv_tls_ca_file=pki["ca"]))


def test_emit_repo_writes_the_tls_files_into_both_phase_models(engine_dir, key_file, pki, tmp_path):  # noqa: F811
    from click.testing import CliRunner

    from trtforge.cli.main import main

    cert, key = pki["server"]
    result = CliRunner().invoke(main, [
        "emit-repo", str(engine_dir), str(tmp_path / "repo"), "--disaggregated",
        "--context-kv-connector", "tcp://0.0.0.0:0", "--context-kv-auth-key-file", key_file,
        "--context-kv-tls-cert-file", cert, "--context-kv-tls-key-file", key,
        "--generation-kv-peers", "10.0.0.1", "--generation-kv-auth-key-file", key_file,
        "--generation-kv-tls-ca-file", pki["ca"]])
    assert result.exit_code == 0, result.output
    context = (tmp_path / "repo" / "context" / "config.pbtxt").read_text()
    generation = (tmp_path / "repo" / "generation" / "config.pbtxt").read_text()
    assert json.dumps(cert) in context and json.dumps(key) in context
    assert json.dumps(pki["ca"]) in generation and json.dumps(pki["ca"]) not in context
