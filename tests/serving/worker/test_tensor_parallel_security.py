"""Tensor parallelism attacked on its own channel, with real gloo groups and the real rank process
(`python -m trtforge.serving.worker.tp_worker`):

* a rogue rank 0 (this test process, holding the key: a compromised or buggy peer) sends forged
  headers and bodies on the raw channel; the rank refuses each before allocating anything for
  it, says what was claimed and what the limit is, and leaves the group;
* a process without the key joins as a rank; rank 0 refuses it before sending it anything;
* a rank that is killed or stopped makes the others fail with a clear error within seconds, not
  after the 300 s meeting timeout;
* rank 0's rendezvous store and gloo listen on loopback only for a one-host launch.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.engine_dir import read_engine_config
from trtforge.serving.engine import LLMEngine, num_kv_blocks
from trtforge.serving.worker import tp_auth, tp_comm
from trtforge.serving.worker.tp_launch import Launch, free_port, open_store
from trtforge.serving.worker.tp_message import INIT, PING, STEP, MessageLimits

KEY = "k" * 16 + "0123456789abcdef0123456789abcdef"
CPU = torch.device("cpu")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               tp_auth.KEY_ENV, tp_auth.KEY_FILE_ENV, tp_comm.PEER_TIMEOUT_ENV)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tp-security")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2", num_attention_heads=4, num_key_value_heads=2)
    return build_engine(str(ckpt), tmp / "tp2", BuildConfig(dtype="float32", max_batch_size=4, max_num_tokens=64,
                                                           kv_cache_memory="1MiB", tp_size=2), progress=False)[0]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "TRTFORGE_TP_TIMEOUT_S": "60", **extra}


def _rank(engine_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trtforge.serving.worker.tp_worker", str(engine_dir)],
                            env=_env(**env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _exit(proc: subprocess.Popen, within_s: float) -> tuple[int, str, float]:
    """(exit status, stderr, seconds it took) of a process that must end within `within_s`."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the rank did not exit within {within_s} s; stderr:\n{err[-3000:]}")
    return proc.returncode, err, time.monotonic() - start


@contextlib.contextmanager
def rogue_rank0(engine_dir: Path, key: str = KEY):
    """This process as rank 0 of a real group with a real rank 1, both holding `key`."""
    launch = Launch(world_size=2, rank=0, local_rank=0, master_addr="127.0.0.1", master_port=0)
    store = open_store(launch)
    rank1 = _rank(engine_dir, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(launch.master_port), **{tp_auth.KEY_ENV: key})
    try:
        deadline = time.monotonic() + 60
        while not store.check(["ready/1"]):
            assert rank1.poll() is None and time.monotonic() < deadline, rank1.stderr.read()[-3000:]
            time.sleep(0.05)
        tp_comm.join_group(store, 0, 2, CPU)
        tp_auth.prove(key.encode(), 0, 2, CPU, tp_comm.gather_rows)
        yield rank1
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.communicate()
        if dist.is_initialized():
            dist.destroy_process_group()


def _header(*values: int) -> torch.Tensor:
    header = torch.zeros(tp_comm.HEADER, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def _init(engine_dir: Path) -> None:
    cfg = read_engine_config(engine_dir)
    tp_comm.send(INIT, CPU, fields=(num_kv_blocks(cfg, None), tp_comm.engine_identity(cfg)), timeout=30)


FORGED_BEFORE_INIT = {
    "a 64 TiB body": (_header(STEP, 1 << 43, 1, 1, 1, 1, 1, 1), "a STEP header claiming"),
    "a negative body": (_header(PING, -5), "claiming a body of -5 values"),
    "an unknown kind": (_header(77, 0), "unknown kind 77"),
    "an INIT asking for 2^40 KV blocks": (_header(INIT, 0, 1 << 40, 0), "this rank's memory holds at most"),
}


@pytest.mark.parametrize("name", sorted(FORGED_BEFORE_INIT))
def test_a_forged_header_is_refused_before_anything_is_allocated(engine_dir, name):
    header, says = FORGED_BEFORE_INIT[name]
    with rogue_rank0(engine_dir) as rank1:
        tp_comm.broadcast(header, 10)
        code, err, took = _exit(rank1, 20)
    assert code == 1 and "refused a message from rank 0" in err and says in err, err[-3000:]
    assert "allocate" not in err.lower(), err[-3000:]  # the refusal, not a failed allocation
    assert took < 10


def _step_body(t: int, s: int, width: int, rows: int, **bad: int) -> torch.Tensor:
    """A well-formed body (token 5 at positions 0.., block 0) with `bad` parts replaced."""
    parts = {"ids": [5] * t, "pos": list(range(t)), "slots": list(range(t)), "tables": [0] * (s * width),
             "seq_lens": [t], "starts": [0, t], "logits": [t - 1] * rows}
    for part, value in bad.items():
        parts[part] = [value] + parts[part][1:]
    return torch.tensor([v for p in parts.values() for v in p], dtype=torch.int64)


FORGED_AFTER_INIT = {
    # T beyond the engine's max_num_tokens (64), with the body length that goes with it: the
    # header is refused, the body never sent
    "more tokens than max_num_tokens": (65, {}, "a step of 65 tokens, outside 1..64"),
    # sizes in range, values not: a block id past the KV pool, a token id outside the vocabulary
    "a block id past the KV pool": (4, {"tables": 10 ** 9}, "block_tables outside"),
    "a token id outside the vocabulary": (4, {"ids": -1}, "input_ids outside"),
}


@pytest.mark.parametrize("name", sorted(FORGED_AFTER_INIT))
def test_a_forged_step_is_refused_by_a_loaded_rank(engine_dir, name):
    t, bad, says = FORGED_AFTER_INIT[name]
    body = _step_body(t, 1, 1, 1, **bad)
    with rogue_rank0(engine_dir) as rank1:
        _init(engine_dir)
        tp_comm.broadcast(_header(STEP, body.numel(), t, 1, 1, 1, t, t), 30)
        if t <= 64:  # the header fits: the body goes out, and its values are checked
            tp_comm.broadcast(body, 30)
        code, err, _ = _exit(rank1, 30)
    assert code == 1 and "refused a message from rank 0" in err and says in err, err[-3000:]


def test_a_well_formed_step_from_rank_0_is_run():
    """The check's other side: a step whose sizes and values fit passes (decode only, no group)."""
    limits = MessageLimits(max_tokens=64, max_seqs=4, max_seq_len=128, block_size=16, vocab_size=500, max_blocks=8)
    body = _step_body(4, 1, 1, 1)
    fields = [4, 1, 1, 1, 4, 4]
    limits.check_header(STEP, body.numel(), fields)
    from trtforge.serving.worker.tp_message import MessageError, decode_step

    inputs = decode_step(body, fields, limits)
    assert inputs.num_tokens == 4 and inputs.meta.block_tables.tolist() == [[0]]
    with pytest.raises(MessageError, match="slot_mapping outside"):
        decode_step(_step_body(4, 1, 1, 1, slots=8 * 16), fields, limits)
    with pytest.raises(MessageError, match="inconsistent"):
        decode_step(body, [4, 1, 1, 1, 3, 4], limits)  # max_query_len not the chunk's length


def test_a_process_without_the_key_is_refused_before_anything_is_sent(engine_dir, monkeypatch):
    port = free_port()
    hosts = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    intruder = _rank(engine_dir, NODE_RANK="1", **hosts, **{tp_auth.KEY_ENV: "i" * 64})
    for name, value in {**hosts, "NODE_RANK": "0", tp_auth.KEY_ENV: KEY}.items():
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(tp_auth.GroupAuthError, match=r"rank\(s\) \[1\] did not prove"):
            LLMEngine.from_engine_dir(engine_dir)
        code, err, _ = _exit(intruder, 30)
    finally:
        if intruder.poll() is None:
            intruder.kill()
    assert not dist.is_initialized()
    # It got no INIT (nor anything after): its own check of rank 0 failed first, and it left.
    assert code == 2 and r"rank(s) [0] did not prove" in err, err[-3000:]


def _wait(predicate, within_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within_s:
            pytest.fail(f"not within {within_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_killed_rank_breaks_an_idle_group_within_a_second(engine_dir):
    engine = LLMEngine.from_engine_dir(engine_dir)
    try:
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].error is None
        child = engine.executor.children[0].process
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: engine.executor.broken is not None, 3)  # no step needed to notice
        assert "rank 1 exited with code -9" in engine.executor.broken
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
        assert out.finish_reason == "error" and "Restart the engine" in out.error
    finally:
        engine.executor.close()


def test_a_stopped_rank_is_an_error_after_the_peer_timeout_not_300_s(engine_dir, monkeypatch):
    monkeypatch.setenv(tp_comm.PEER_TIMEOUT_ENV, "2")
    engine = LLMEngine.from_engine_dir(engine_dir)
    child = engine.executor.children[0].process
    try:
        os.kill(child.pid, signal.SIGSTOP)  # alive, connections open, answering nothing
        took = _wait(lambda: engine.executor.broken is not None, 8)
        assert took > 1.5 and "stopped answering for 2 s" in engine.executor.broken, engine.executor.broken
        start = time.monotonic()
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
        assert out.finish_reason == "error" and time.monotonic() - start < 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        engine.executor.close()


def _readline(proc: subprocess.Popen, within_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    return proc.stdout.readline() if ready else ""


RANK0 = "import sys, time\nfrom trtforge.serving.engine import LLMEngine\n" \
        "engine = LLMEngine.from_engine_dir(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(600)\n"


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_rank_1_stops_within_seconds_when_rank_0_is_killed_or_stopped(engine_dir, how):
    hosts = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **{tp_auth.KEY_ENV: KEY},
                 **{tp_comm.PEER_TIMEOUT_ENV: "2"})
    rank1 = _rank(engine_dir, NODE_RANK="1", **hosts)
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(engine_dir)], env=_env(NODE_RANK="0", **hosts),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert _readline(rank0, 90).strip() == "ready"
        time.sleep(1.5)  # idle, pinging: rank 1 waits for the next message
        assert rank1.poll() is None
        os.kill(rank0.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        code, err, took = _exit(rank1, 10)
    finally:
        for proc in (rank0, rank1):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert code == 1 and "the tensor-parallel group broke" in err, err[-3000:]
    if how == "stopped":
        assert "rank 0 sent nothing for 2 s" in err and took > 1.5, err[-3000:]
    else:
        assert took < 5, err[-3000:]


def _listening(pid: int) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The (address, port) the process's listening TCP sockets are bound to."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    raw = bytes.fromhex(addr)
                    if v6:  # four 32-bit words, each in host (little-endian) order
                        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                    else:
                        ip = ipaddress.IPv4Address(raw[::-1])
                    found.add((ip, int(port, 16)))
    return found


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_one_host_group_listens_on_loopback_only(engine_dir):
    before = _listening(os.getpid())
    engine = LLMEngine.from_engine_dir(engine_dir)
    try:
        ours = _listening(os.getpid()) - before
        child = _listening(engine.executor.children[0].process.pid)
        assert ours and child, "rank 0 hosts the store and gloo listens in both"
        outside = {f"{ip}:{port}" for ip, port in ours | child if not _loopback(ip)}
        assert not outside, f"listening beyond loopback: {sorted(outside)}"
    finally:
        engine.executor.close()


def test_the_key_is_required_across_hosts_and_must_be_private(tmp_path):
    with pytest.raises(tp_auth.GroupAuthError, match="ranks on several hosts .* need a key"):
        tp_auth.group_key("192.0.2.7", spawns_all=False, env={})
    with pytest.raises(tp_auth.GroupAuthError, match="too short"):
        tp_auth.group_key("192.0.2.7", spawns_all=False, env={tp_auth.KEY_ENV: "short"})
    key_file = tmp_path / "tp.key"
    key_file.write_text(KEY)
    key_file.chmod(0o644)
    with pytest.raises(tp_auth.GroupAuthError, match="accessible to other users"):
        tp_auth.group_key("192.0.2.7", spawns_all=False, env={tp_auth.KEY_FILE_ENV: str(key_file)})
    key_file.chmod(0o600)
    assert tp_auth.group_key("192.0.2.7", spawns_all=False, env={tp_auth.KEY_FILE_ENV: str(key_file)}) == KEY.encode()
    assert tp_auth.group_key("192.0.2.7", spawns_all=False, env={tp_auth.KEY_ENV: KEY}) == KEY.encode()
    # One host, rank 0 starting every rank: a fresh key each launch, nothing to configure.
    fresh = {tp_auth.group_key("127.0.0.1", spawns_all=True, env={}) for _ in range(2)}
    assert len(fresh) == 2 and all(len(k) >= 32 for k in fresh)
