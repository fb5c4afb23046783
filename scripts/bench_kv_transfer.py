"""KV handoff transfer rate (docs/scale-out.md, docs/benchmarks.md): the shared-memory and TCP
connectors (plain and TLS, with a throwaway certificate) vs a plain loopback socket copy of the
same bytes, in one run.

A 0.5B-shaped (Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, float32) KV pool; one prompt of
--tokens tokens is exported by a context-side connector and imported into a second pool, as the
context and generation engines do. Timings are medians over --repeat handoffs.

    .venv/bin/python scripts/bench_kv_transfer.py [--tokens 2000] [--repeat 10]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from trtforge.config.runtime import RuntimeConfig
from trtforge.serving.kv_connector import KVHandle, KVImporter, SharedMemoryExporter, TcpExporter
from trtforge.serving.kv_connector.tls import client_context, server_context

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 24, 2, 64, 16


def pools(num_blocks: int) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]


def handoff(exporter, importer: KVImporter, src: list[torch.Tensor], dst: list[torch.Tensor],
            blocks: list[int], tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    handle = exporter.save_kv("bench", blocks, tokens, prompt_token_ids=[0] * tokens, first_token=0, seed=0)
    t1 = time.perf_counter()
    importer.load_kv(KVHandle.from_json(handle.to_json()), blocks)
    t2 = time.perf_counter()
    exporter.poll()
    assert torch.equal(dst[0][:, blocks], src[0][:, blocks]) and torch.equal(dst[-1][:, blocks], src[-1][:, blocks])
    return t1 - t0, t2 - t1, handle.nbytes


def socket_copy(nbytes: int) -> float:
    """Seconds to send nbytes over a loopback TCP connection (sendall of one buffer, recv_into
    another): the bound for the network part of a handoff."""
    payload = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(payload)

    thread = threading.Thread(target=serve)
    thread.start()
    buf = bytearray(nbytes)
    t0 = time.perf_counter()
    got, view = 0, memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        while got < nbytes:  # straight into the buffer, as the connector receives into the pool
            n = conn.recv_into(view[got:])
            if n == 0:
                break
            got += n
    seconds = time.perf_counter() - t0
    thread.join()
    server.close()
    assert got == nbytes
    return seconds


def self_signed(directory: Path) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (its own CA), and its key: (cert file, key file)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return str(cert_file), str(key_file)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the block copies (memory-bound; one avoids OpenMP waits "
                         "on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    nblocks = -(-args.tokens // BLOCK)
    src, dst = pools(nblocks * 2), pools(nblocks * 2)
    blocks = list(range(nblocks // 2, nblocks // 2 + nblocks))
    importer = KVImporter(dst, BLOCK)
    cert, key = self_signed(Path(tempfile.mkdtemp()))
    tls_importer = KVImporter(dst, BLOCK, peers="127.0.0.1", tls=client_context(cert, None, None))
    timeout_s = RuntimeConfig().handoff_timeout_s
    report = {"tokens": args.tokens, "blocks": nblocks, "repeat": args.repeat}
    for name, make in (("shm", lambda: SharedMemoryExporter(src, nblocks * 2, BLOCK, timeout_s)),
                       ("tcp_loopback", lambda: TcpExporter(src, nblocks * 2, BLOCK, timeout_s,
                                                            listen="tcp://127.0.0.1:0", advertise_host=None)),
                       ("tcp_tls_loopback", lambda: TcpExporter(src, nblocks * 2, BLOCK, timeout_s,
                                                                listen="tcp://127.0.0.1:0", advertise_host=None,
                                                                tls=server_context(cert, key, None)))):
        exporter = make()
        taker = tls_importer if name == "tcp_tls_loopback" else importer
        try:
            handoff(exporter, taker, src, dst, blocks, args.tokens)  # warm-up: faults the pages in
            runs = [handoff(exporter, taker, src, dst, blocks, args.tokens) for _ in range(args.repeat)]
        finally:
            exporter.close()
        export_s = statistics.median(r[0] for r in runs)
        import_s = statistics.median(r[1] for r in runs)
        nbytes = runs[0][2]
        report[name] = {"bytes": nbytes, "export_ms": 1e3 * export_s, "import_ms": 1e3 * import_s,
                        "total_ms": 1e3 * (export_s + import_s), "us_per_block": 1e6 * (export_s + import_s) / nblocks,
                        "GB_per_s": nbytes / (export_s + import_s) / 1e9,
                        "import_GB_per_s": nbytes / import_s / 1e9}
    nbytes = report["shm"]["bytes"]
    socket_copy(nbytes)
    plain = statistics.median(socket_copy(nbytes) for _ in range(args.repeat))
    report["plain_socket_loopback"] = {"bytes": nbytes, "ms": 1e3 * plain, "GB_per_s": nbytes / plain / 1e9}
    # The network part of a TCP handoff is its import (fetch + land in the pool): that is what a
    # plain socket copy of the same bytes bounds.
    report["tcp_import_vs_plain_socket"] = (report["tcp_loopback"]["import_GB_per_s"]
                                            / report["plain_socket_loopback"]["GB_per_s"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
