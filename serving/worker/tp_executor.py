"""Rank 0 of a tensor-parallel engine: the same Executor as at tp 1, so engine.py's loop is unchanged.

    LLMEngine.step ─▶ prepare_inputs ─▶ TensorParallelExecutor.execute(inputs)
                                            │ broadcast the step (tp_comm: int64 header + body)
                                            ├─▶ rank 1..N-1: tp_worker loop, same step on their shards
                                            ▼
                                        rank 0's shard ─ all-reduce ×2 per layer ─ all-gather logits ─▶ logits

The scheduler, the sampler and the detokenizer stay in this process. It starts the ranks of its
own host (tp_launch.py); ranks on other hosts join at MASTER_ADDR:MASTER_PORT. Every rank proves
the group's key before rank 0 sends it anything (tp_auth.py).

A rank that dies breaks the group at once: gloo sees its closed connection in the next collective,
and while idle a ping thread checks the ranks started here every quarter second and PINGs every
rank each second (each answers; a silent one is an error after TRTFORGE_TP_PEER_TIMEOUT_S).
Broken, rank 0 writes why into the store and closes the group's connections, so the other ranks
stop at once with that reason; `broken` says it, the next step raises TensorParallelError with it
(the engine fails that step's requests), and so does every later one: a broken group is not
repaired, the engine must be restarted. `close()` (also at exit) sends STOP and waits for the
ranks it started.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch
import torch.distributed as dist

from trtforge.models.engine_dir import EngineConfig
from trtforge.serving.worker import tp_auth, tp_comm
from trtforge.serving.worker.model_inputs import ModelInputs
from trtforge.serving.worker.tp_launch import (
    Child,
    LaunchError,
    bind_transport,
    launch_from_env,
    open_store,
    spawn_ranks,
    stop_children,
    wait_for_ranks,
)
from trtforge.serving.worker.tp_message import MessageLimits, encode_step
from trtforge.serving.worker.tp_rank import cpu_threads, load_rank, rank_device


class TensorParallelError(RuntimeError):
    """The tensor-parallel group broke (a rank died or stopped answering)."""


class _Group:
    """The process group as rank 0 holds it: the lock every broadcast takes, the ranks it started,
    broken/closed. Apart from the executor so that a dropped executor is closed by its finalizer
    (and at exit), and the ping thread holds only this."""

    def __init__(self, tp_size: int, device: torch.device, children: list[Child], store: dist.Store):
        self.tp_size, self.device, self.children, self.store = tp_size, device, children, store
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.closed = False
        self.last = time.monotonic()

    def break_(self, exc: BaseException) -> str:
        """Record why the group broke, tell the other ranks (the store) and close its connections,
        so that those waiting on rank 0 stop at once. Called with the lock held."""
        time.sleep(0.2)  # a dying rank's exit code is known a moment after its connection closed
        dead = [c.describe_exit() for c in self.children if c.process.poll() is not None]
        cause = f"{type(exc).__name__}: {exc}"
        if not dead and "timed out" in str(exc).lower():
            cause = (f"a rank stopped answering for {tp_comm.peer_timeout_s():g} s ({tp_comm.PEER_TIMEOUT_ENV}; "
                     f"a lost host or a stopped process): {cause}")
        self.broken = (f"the tensor-parallel group of {self.tp_size} ranks broke: "
                       + ("; ".join(dead) if dead else cause) + ". Restart the engine (every rank).")
        try:
            self.store.set(tp_comm.BROKEN_KEY, self.broken)
        except RuntimeError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
        return self.broken

    def ping_loop(self) -> None:
        interval = tp_comm.ping_interval_s()
        while True:
            time.sleep(interval / 4)
            with self.lock:
                if self.closed or self.broken:
                    return
                dead = [c.rank for c in self.children if c.process.poll() is not None]
                if dead:  # a rank started here has exited: no need to wait for a collective to fail
                    self.break_(RuntimeError(f"ranks {dead} exited"))
                    return
                if time.monotonic() - self.last < interval:
                    continue
                try:
                    tp_comm.send(tp_comm.PING, self.device)
                except RuntimeError as exc:
                    self.break_(exc)
                    return
                self.last = time.monotonic()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if not self.broken:
                try:
                    tp_comm.send(tp_comm.STOP, self.device)
                except RuntimeError:
                    pass
        stop_children(self.children)
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelExecutor:
    def __init__(self, engine_dir: str, cfg: EngineConfig, num_blocks: int, device: str | torch.device = "cpu"):
        self.tp_size = cfg.tp_size
        launch = launch_from_env(cfg.tp_size)
        if launch.rank != 0:
            raise LaunchError(f"this process is rank {launch.rank} (NODE_RANK/RANK in the environment); rank 0 runs "
                              f"`trtforge generate`, the benchmarks or the Triton model, the others `trtforge "
                              f"tp-worker {engine_dir}`.")
        self.device = rank_device(device, launch.local_rank)
        threads = cpu_threads(launch) if self.device.type == "cpu" else None
        if threads:
            torch.set_num_threads(min(torch.get_num_threads(), threads))
        self.launch = launch
        key = tp_auth.group_key(launch.master_addr, launch.spawns_all)
        self.limits = MessageLimits.for_engine(cfg, num_blocks)
        bind_transport(launch)
        store = open_store(launch)
        self.children = spawn_ranks(launch, engine_dir, str(device), threads, key)
        try:
            wait_for_ranks(store, launch, self.children)
            tp_comm.join_group(store, 0, launch.world_size, self.device)
            tp_auth.prove(key, 0, launch.world_size, self.device, tp_comm.gather_rows)  # before anything is sent
            meeting = tp_comm.timeout_s()
            tp_comm.send(tp_comm.INIT, self.device, fields=(num_blocks, tp_comm.engine_identity(cfg)), timeout=meeting)
            self.local, self.collectives = load_rank(engine_dir, cfg, 0, num_blocks, self.device)
            tp_comm.send(tp_comm.PING, self.device, timeout=meeting)  # answered once every rank has loaded
        except BaseException:
            for c in self.children:
                if c.process.poll() is None:
                    c.process.kill()
                c.process.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self._store = store  # rank 0 hosts it: it lives as long as the group
        self._group = _Group(cfg.tp_size, self.device, self.children, store)
        self._finalizer = weakref.finalize(self, self._group.close)  # when dropped, and at exit
        threading.Thread(target=self._group.ping_loop, name="trtforge-tp-ping", daemon=True).start()

    def describe(self) -> str:
        where = f"{len(self.children) + 1} on this host" if self.children else "on several hosts"
        return (f"tensor parallel: {self.tp_size} ranks ({where}, {tp_comm.backend_for(self.device)}); "
                f"rank 0: {self.local.describe()}")

    @property
    def broken(self) -> str | None:
        """Why the group broke (None while it works)."""
        return self._group.broken

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        g = self._group
        body, fields = encode_step(inputs, self.limits)  # a step beyond the limits fails alone
        with g.lock:
            if g.broken:
                raise TensorParallelError(g.broken)
            if g.closed:
                raise TensorParallelError("the tensor-parallel engine was closed.")
            try:
                tp_comm.send(tp_comm.STEP, self.device, body.to(self.device), fields)
                logits = self.local.execute(inputs)
            except RuntimeError as exc:
                raise TensorParallelError(g.break_(exc)) from exc
            g.last = time.monotonic()
            return logits

    def close(self) -> None:
        """Stop the other ranks (STOP message), wait for those this process started, leave the group."""
        self._finalizer()
