"""KV handoff security (issue 23): handles cannot be forged, guessed, altered or replayed; the TCP
connector serves a handle's own blocks once, to whoever names its secret, and survives raw-socket
clients; a generation engine judges every field of a handle before admission, fetches only from
the connectors it was configured for, and never puts imported KV into its prefix cache.

Every attack is refused with a clear error while a good request on the same engines finishes with
exactly the co-located tokens, and no KV block is left held on either side."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time

import pytest

from tests.serving.test_disaggregated_engine import PROMPTS, _drain, _tokens, engine_dir  # noqa: F401 - fixture
from trtforge.config.runtime import RuntimeConfig, parse_listen_address
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.kv_connector import HandoffError, KVHandle, tcp
from trtforge.serving.kv_connector.auth import KEY_ENV, handoff_key

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "kv.key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def colocated(engine_dir):  # noqa: F811 - the imported fixture
    engine = LLMEngine.from_engine_dir(engine_dir)
    return {p: o.output_token_ids for p, o in zip(PROMPTS, engine.generate(PROMPTS, [PARAMS] * len(PROMPTS)))}


@pytest.fixture
def tcp_phases(engine_dir, key_file):  # noqa: F811
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        phase="context", kv_connector="tcp://127.0.0.1:0", kv_auth_key_file=key_file))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        phase="generation", kv_peers="127.0.0.1", kv_auth_key_file=key_file))
    yield ctx, gen
    ctx.close()


@pytest.fixture
def shm_phases(engine_dir):  # noqa: F811
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context"))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation"))
    yield ctx, gen
    ctx.close()


def _handoff(ctx: LLMEngine, prompt: str) -> KVHandle:
    out = ctx.generate([prompt], PARAMS)[0]
    assert out.kv_handle is not None
    return KVHandle.from_json(out.kv_handle.to_json())


def _finish(gen: LLMEngine, handle: KVHandle) -> list:
    rid = gen.add_handoff(handle, PARAMS)
    return [o for o in _drain(gen) if o.request_id == rid]


def _raw(address, payload: bytes, read_timeout: float = 5.0) -> dict:
    """A raw TCP client: send `payload`, read the framed answer (4-byte length + JSON)."""
    with socket.create_connection(address, timeout=read_timeout) as conn:
        conn.sendall(payload)
        size = int.from_bytes(_recv(conn, 4), "little")
        return json.loads(_recv(conn, size))


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _take(handle: KVHandle, **changes) -> bytes:
    request = {"op": "take", "slot": handle.slot, "nonce": handle.nonce, "secret": handle.secret,
               "mac": handle.mac, "blocks": handle.blocks, **changes}
    return json.dumps(request).encode() + b"\n"


def _idle(ctx: LLMEngine, gen: LLMEngine) -> None:
    ctx.poll()
    assert ctx.stats().kv_handoff_blocks_held == 0 and ctx.stats().kv_blocks_used == 0
    assert gen.stats().kv_blocks_used == 0 and gen.stats().num_running == 0


def test_raw_socket_attacks_on_the_tcp_connector_are_refused(tcp_phases, colocated, monkeypatch):
    ctx, gen = tcp_phases
    monkeypatch.setattr(tcp, "_REQUEST_TIMEOUT_S", 0.5)
    exporter = ctx.connector
    address = exporter.address
    assert address[0] == "127.0.0.1"
    handle = _handoff(ctx, PROMPTS[2])
    # A client that connects and never sends a line: dropped after the request timeout.
    slow = socket.create_connection(address, timeout=5)
    # The attack: a free slot, nonce 0, any blocks.
    answer = _raw(address, b'{"slot": 4095, "nonce": 0, "blocks": [0, 1, 2, 3]}\n')
    assert answer["ok"] is False and "op take or release" in answer["error"]
    answer = _raw(address, b'{"op": "take", "slot": 4095, "nonce": 0, "blocks": [0, 1, 2, 3]}\n')
    assert answer["ok"] is False and "not held by this context server" in answer["error"]
    # Guessed secret, forged signature, guessed nonce: all of the real slot.
    for changes in (dict(secret="0" * 32), dict(mac="f" * 64), dict(nonce=handle.nonce + 1),
                    dict(secret=None), dict(slot="0")):
        answer = _raw(address, _take(handle, **changes))
        assert answer["ok"] is False and "not held" in answer["error"], changes
    # The right secret, but blocks that are not the handle's.
    answer = _raw(address, _take(handle, blocks=[0, 1, 2, 3]))
    assert answer["ok"] is False and "not its own" in answer["error"]
    # Oversized and malformed lines.
    answer = _raw(address, b"{" + b" " * 10_000)
    assert answer["ok"] is False and "longer than 4096" in answer["error"]
    answer = _raw(address, b"not json\n")
    assert answer["ok"] is False
    # The slow client got an error and the server closed it.
    size = int.from_bytes(_recv(slow, 4), "little")
    assert "in time" in json.loads(_recv(slow, size))["error"]
    assert slow.recv(1) == b""
    slow.close()
    # None of that took the handle: the good request finishes with the co-located tokens.
    outs = _finish(gen, handle)
    assert outs[-1].finish_reason == "length" and _tokens(outs) == colocated[PROMPTS[2]][1:]
    # Replayed: to the server (already taken) and to the engine (already used).
    answer = _raw(address, _take(handle))
    assert answer["ok"] is False and ("already taken" in answer["error"] or "not held" in answer["error"])
    with pytest.raises(ValueError, match="already used"):
        gen.add_handoff(handle, PARAMS)
    _idle(ctx, gen)
    assert gen.stats().kv_handoffs_total == 1


def test_the_connector_bounds_its_connections(tcp_phases, colocated):
    ctx, gen = tcp_phases
    address = ctx.connector.address
    idle = [socket.create_connection(address, timeout=5) for _ in range(tcp.MAX_CONNECTIONS + 4)]
    try:
        deadline = time.monotonic() + 5
        while ctx.connector.connections_refused < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctx.connector.connections_refused >= 4  # closed at once, not queued
    finally:
        for conn in idle:
            conn.close()
    time.sleep(0.2)  # the served ones see their clients gone and free their threads
    handle = _handoff(ctx, PROMPTS[0])
    assert _tokens(_finish(gen, handle)) == colocated[PROMPTS[0]][1:]
    _idle(ctx, gen)


def test_the_importer_bounds_the_header_before_allocating(tcp_phases):
    ctx, gen = tcp_phases
    handle = _handoff(ctx, PROMPTS[1])
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def serve():
        conn, _ = fake.accept()
        with conn:
            conn.recv(4096)
            conn.sendall((1 << 31).to_bytes(4, "little"))  # a 2 GiB "header"
            time.sleep(0.5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    evil = dataclasses.replace(handle, location=f"tcp://127.0.0.1:{port}")
    with pytest.raises(HandoffError, match="header"):
        tcp.TcpImporter().import_into(evil, gen.connector.kv_tensors, list(range(len(handle.blocks))))
    thread.join()
    fake.close()
    gen.connector.request_finished(handle)
    _idle(ctx, gen)


def test_forged_handles_are_refused_and_a_good_one_finishes(shm_phases, colocated):
    ctx, gen = shm_phases
    key = gen.connector.key
    vocab = gen.engine_config.model.vocab_size
    good = _handoff(ctx, PROMPTS[2])
    held = ctx.stats().kv_handoff_blocks_held
    forged = [
        (dataclasses.replace(good, first_token=good.first_token + 1), "not authenticated"),
        (dataclasses.replace(good, mac="0" * 64), "not authenticated"),
        (dataclasses.replace(good, mac=""), "not authenticated"),
        (dataclasses.replace(good, prompt_token_ids=[1] * good.num_tokens), "not authenticated"),
        # Signed with another key (a context side of another deployment, or a guess).
        (dataclasses.replace(good, slot=4095, nonce=0).sign(os.urandom(32)), "not authenticated"),
        # Even signed with the right key (a context side's bug): every field is range-checked.
        (dataclasses.replace(good, first_token=vocab).sign(key), "outside the vocabulary"),
        (dataclasses.replace(good, prompt_token_ids=[vocab + 5] * good.num_tokens).sign(key),
         "outside the vocabulary"),
        (dataclasses.replace(good, num_tokens=good.num_tokens + 1).sign(key), "num_tokens"),
        (dataclasses.replace(good, blocks=good.blocks[:1]).sign(key), "blocks for"),
        (dataclasses.replace(good, block_size=good.block_size * 2).sign(key), "block size"),
        (dataclasses.replace(good, nonce=0).sign(key), "out of range"),
        (dataclasses.replace(good, generator_state="zz").sign(key), "generator_state"),
        (dataclasses.replace(good, location="tcp://attacker.example:80").sign(key),
         "not a context server this generation engine fetches from"),
        (dataclasses.replace(good, location="/etc/passwd").sign(key), "not a handoff segment"),
        (dataclasses.replace(good, location=good.location + "x").sign(key), "not a handoff segment"),
    ]
    for handle, message in forged:
        with pytest.raises(ValueError, match=message):
            gen.add_handoff(KVHandle.from_json(handle.to_json()), PARAMS)
    # Refused handles are not released: the good handoff (same slot) still waits for its taker.
    ctx.poll()
    assert ctx.stats().kv_handoff_blocks_held == held > 0 and gen.stats().kv_blocks_used == 0
    # A signed handle naming the real segment's free slot: nothing to take there.
    free = dataclasses.replace(good, slot=(good.slot + 1) % 4096, nonce=12345).sign(key)
    outs = _finish(gen, free)
    assert outs[-1].finish_reason == "error" and "expired" in outs[-1].error
    outs = _finish(gen, good)
    assert outs[-1].finish_reason == "length" and _tokens(outs) == colocated[PROMPTS[2]][1:]
    with pytest.raises(ValueError, match="already used"):
        gen.add_handoff(good, PARAMS)
    with pytest.raises(HandoffError, match="malformed"):
        KVHandle.from_json(json.dumps({**json.loads(good.to_json()), "slot": "1"}))
    with pytest.raises(HandoffError, match="unknown field"):
        KVHandle.from_json(json.dumps({**json.loads(good.to_json()), "evil": 1}))
    _idle(ctx, gen)


def test_imported_kv_never_enters_the_prefix_cache(shm_phases, colocated):
    ctx, gen = shm_phases
    handle = _handoff(ctx, PROMPTS[2])
    assert handle.num_tokens >= 2 * handle.block_size
    outs = _finish(gen, handle)
    assert _tokens(outs) == colocated[PROMPTS[2]][1:]
    kv = gen.scheduler.kv_manager
    assert kv.num_cached_blocks == 0
    _idle(ctx, gen)


def test_keys_are_required_across_hosts_and_must_match(engine_dir, key_file, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a key shared by the context and the generation"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", kv_connector="tcp://:0"))
    with pytest.raises(ValueError, match="kv_auth_key_file"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation", kv_peers="hostA"))
    loose = tmp_path / "loose.key"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        handoff_key(str(loose), one_host=False)
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 32"):
        handoff_key(str(short), one_host=False)
    with pytest.raises(ValueError, match="cannot be read"):
        handoff_key(str(tmp_path / "missing.key"), one_host=False)
    monkeypatch.setenv(KEY_ENV, "k" * 40)
    assert handoff_key(None, one_host=False) == b"k" * 40
    # The environment's key against the file's: the handle is refused, nothing is held.
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", kv_connector="tcp://:0"))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation", kv_peers="127.0.0.1",
                                                              kv_auth_key_file=key_file))
    try:
        assert ctx.connector.address[0] == "127.0.0.1"  # no host: loopback only
        handle = _handoff(ctx, PROMPTS[0])
        with pytest.raises(ValueError, match="not authenticated"):
            gen.add_handoff(handle, PARAMS)
        # A generation engine with kv_peers takes no shared-memory handle, one without no tcp one.
        shm_gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation"))
        with pytest.raises(ValueError, match="kv_peers"):
            shm_gen.add_handoff(dataclasses.replace(handle).sign(shm_gen.connector.key), PARAMS)
    finally:
        ctx.close()
    assert gen.stats().kv_blocks_used == 0


def test_listen_addresses():
    assert parse_listen_address("tcp://:7000") == ("127.0.0.1", 7000)
    assert parse_listen_address("tcp://0.0.0.0:7000") == ("0.0.0.0", 7000)
    assert parse_listen_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
    with pytest.raises(ValueError, match="kv_peers entry"):
        RuntimeConfig(phase="generation", kv_peers="tcp://host:x")
