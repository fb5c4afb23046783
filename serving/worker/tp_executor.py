"""Rank 0 of a tensor-parallel engine: the same Executor as at tp 1, so engine.py's loop is unchanged.

    LLMEngine.step ─▶ prepare_inputs ─▶ TensorParallelExecutor.execute(inputs)
                                            │ broadcast the step (tp_comm: int64 header + body)
                                            ├─▶ rank 1..N-1: tp_worker loop, same step on their shards
                                            ▼
                                        rank 0's shard ─ all-reduce ×2 per layer ─ all-gather logits ─▶ logits

The scheduler, the sampler and the detokenizer stay in this process. It starts the ranks of its
own host (tp_launch.py); ranks on other hosts join at MASTER_ADDR:MASTER_PORT. A rank that dies
makes the next step raise TensorParallelError naming it (gloo sees the closed connection; a silent
peer hits the group's timeout); the engine fails that step's requests with the message, and every
later step too: a broken group is not repaired, the engine must be restarted. While idle, a PING
every timeout/5 seconds keeps the waiting ranks inside their timeout. `close()` (also at exit)
sends STOP and waits for the ranks it started.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch
import torch.distributed as dist

from trtforge.models.engine_dir import EngineConfig
from trtforge.serving.worker import tp_comm
from trtforge.serving.worker.model_inputs import ModelInputs
from trtforge.serving.worker.tp_launch import (
    Child,
    LaunchError,
    launch_from_env,
    open_store,
    spawn_ranks,
    stop_children,
    wait_for_ranks,
)
from trtforge.serving.worker.tp_rank import cpu_threads, load_rank, rank_device


class TensorParallelError(RuntimeError):
    """The tensor-parallel group broke (a rank died or stopped answering)."""


class _Group:
    """The process group as rank 0 holds it: the lock every broadcast takes, the ranks it started,
    broken/closed. Apart from the executor so that a dropped executor is closed by its finalizer
    (and at exit), and the ping thread holds only this."""

    def __init__(self, tp_size: int, device: torch.device, children: list[Child]):
        self.tp_size, self.device, self.children = tp_size, device, children
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.closed = False
        self.last = time.monotonic()

    def break_(self, exc: BaseException) -> str:
        time.sleep(0.2)  # a dying rank's exit code is known a moment after its connection closed
        dead = [c.describe_exit() for c in self.children if c.process.poll() is not None]
        self.broken = (f"the tensor-parallel group of {self.tp_size} ranks broke: "
                       + ("; ".join(dead) if dead else f"{type(exc).__name__}: {exc}")
                       + ". Restart the engine (every rank).")
        return self.broken

    def ping_loop(self) -> None:
        interval = tp_comm.timeout_s() / 5
        while True:
            time.sleep(min(interval, 5.0))
            with self.lock:
                if self.closed or self.broken:
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
        store = open_store(launch)
        self.children = spawn_ranks(launch, engine_dir, str(device), threads)
        try:
            wait_for_ranks(store, launch, self.children)
            tp_comm.join_group(store, 0, launch.world_size, self.device)
            tp_comm.send(tp_comm.INIT, self.device, fields=(num_blocks, tp_comm.engine_identity(cfg)))
            self.local, self.collectives = load_rank(engine_dir, cfg, 0, num_blocks, self.device)
        except BaseException:
            for c in self.children:
                if c.process.poll() is None:
                    c.process.kill()
                c.process.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self._store = store  # rank 0 hosts it: it lives as long as the group
        self._group = _Group(cfg.tp_size, self.device, self.children)
        self._finalizer = weakref.finalize(self, self._group.close)  # when dropped, and at exit
        threading.Thread(target=self._group.ping_loop, name="trtforge-tp-ping", daemon=True).start()

    def describe(self) -> str:
        where = f"{len(self.children) + 1} on this host" if self.children else "on several hosts"
        return (f"tensor parallel: {self.tp_size} ranks ({where}, {tp_comm.backend_for(self.device)}); "
                f"rank 0: {self.local.describe()}")

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        g = self._group
        with g.lock:
            if g.broken:
                raise TensorParallelError(g.broken)
            if g.closed:
                raise TensorParallelError("the tensor-parallel engine was closed.")
            try:
                body, fields = tp_comm.encode_step(inputs)
                tp_comm.send(tp_comm.STEP, self.device, body.to(self.device), fields)
                logits = self.local.execute(inputs)
            except RuntimeError as exc:
                raise TensorParallelError(g.break_(exc)) from exc
            g.last = time.monotonic()
            return logits

    def close(self) -> None:
        """Stop the other ranks (STOP message), wait for those this process started, leave the group."""
        self._finalizer()
