"""Ranks > 0 of a tensor-parallel engine: receive each step from rank 0, run this rank's shard.

    python -m trtforge.serving.worker.tp_worker ENGINE_DIR [--device cpu|cuda]   (= trtforge tp-worker)

with the launch in torchrun's environment variables (tp_launch.py): RANK/WORLD_SIZE for one
process per rank, or NNODES/NODE_RANK for a host whose first process starts the host's others.
Rank 0 starts its own host's ranks this way; on another host this is the command to run. It
holds no scheduler and no sampler: it proves the group's key (tp_auth.py), then loops on rank 0's
messages until STOP. It exits with an error (status 1, the reason on stderr) when rank 0 goes
away or ends the group (a closed connection; the reason rank 0 left in the store), when rank 0
sends nothing for TRTFORGE_TP_PEER_TIMEOUT_S seconds, and when a message does not fit this
rank's engine (tp_message.py: refused before anything is allocated for it); status 2 for a
launch it cannot make (the environment, the key).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta

import torch

from trtforge.models.engine_dir import read_engine_config
from trtforge.serving.worker import tp_auth, tp_comm
from trtforge.serving.worker.tp_launch import (
    THREADS_ENV,
    LaunchError,
    bind_transport,
    launch_from_env,
    open_store,
    spawn_ranks,
    stop_children,
)
from trtforge.serving.worker.tp_message import MessageError, MessageLimits, decode_step
from trtforge.serving.worker.tp_rank import cpu_threads, load_rank, rank_device


class GroupBroken(RuntimeError):
    """Rank 0 went away, ended the group or stopped answering (the message says which)."""


def _reason(store: torch.distributed.Store, wait_s: float = 2.0) -> str | None:
    """The reason rank 0 left in its store, if it left one and answers within `wait_s` (its store
    lives in its process: gone with it, or silent when it is stopped, where a store call would
    block; so the call runs in a thread that is given up on)."""
    found: list[str] = []

    def ask() -> None:
        try:
            store.set_timeout(timedelta(seconds=wait_s))
            if store.check([tp_comm.BROKEN_KEY]):
                found.append(store.get(tp_comm.BROKEN_KEY).decode(errors="replace"))
        except RuntimeError:
            pass

    thread = threading.Thread(target=ask, name="trtforge-tp-reason", daemon=True)
    thread.start()
    thread.join(wait_s)
    return found[0] if found else None


def _why(store: torch.distributed.Store | None, exc: RuntimeError) -> str:
    """What broke the group, from this rank's side: rank 0's reason when it left one in the store."""
    reason = _reason(store) if store is not None else None
    if reason:
        return f"rank 0 ended the group: {reason}"
    if "timed out" in str(exc).lower():
        return (f"rank 0 sent nothing for {tp_comm.peer_timeout_s():g} s ({tp_comm.PEER_TIMEOUT_ENV}): "
                f"it stopped answering ({type(exc).__name__}: {exc})")
    return f"{type(exc).__name__}: {exc}"


def serve_rank(engine_dir: str, device: str = "cpu") -> int:
    """Run this process's rank until rank 0 says STOP; returns the steps run. GroupBroken when the
    group breaks, MessageError for a message it refuses, LaunchError / GroupAuthError."""
    cfg = read_engine_config(engine_dir)
    launch = launch_from_env(cfg.tp_size)
    if launch.rank == 0:
        raise LaunchError("this process would be rank 0 (RANK=0 or NODE_RANK=0): rank 0 runs `trtforge generate`, "
                          "`trtforge bench offline` or the Triton model, which start or wait for the other ranks; "
                          "`trtforge tp-worker` runs ranks > 0.")
    key = tp_auth.group_key(launch.master_addr, spawns_all=False)
    dev = rank_device(device, launch.local_rank)
    threads = cpu_threads(launch) if dev.type == "cpu" and (launch.spawn or os.environ.get(THREADS_ENV)) else None
    if threads:
        torch.set_num_threads(threads)
    bind_transport(launch)
    children = spawn_ranks(launch, engine_dir, device, threads, key)
    store = None
    try:
        store = open_store(launch)
        store.set(f"ready/{launch.rank}", "1")
        tp_comm.join_group(store, launch.rank, launch.world_size, dev)
        tp_auth.prove(key, launch.rank, launch.world_size, dev, tp_comm.gather_rows)
        meeting = tp_comm.timeout_s()
        limits = MessageLimits.for_engine(cfg, tp_comm.max_kv_blocks(cfg, launch.rank, dev))
        kind, fields, _ = tp_comm.receive(dev, limits, meeting)
        if kind != tp_comm.INIT:
            raise MessageError(f"rank {launch.rank}: expected the INIT message from rank 0, got kind {kind}")
        num_blocks, identity = fields[0], fields[1]
        if identity != tp_comm.engine_identity(cfg):
            raise LaunchError(f"rank {launch.rank} loaded {engine_dir}, whose files differ from rank 0's engine: "
                              "every host needs a copy of the same engine directory.")
        limits = limits.with_blocks(num_blocks)
        executor, _ = load_rank(engine_dir, cfg, launch.rank, num_blocks, dev)
        timeout, steps = meeting, 0  # the first message after loading waits for every rank to load
        while True:
            kind, fields, body = tp_comm.receive(dev, limits, timeout)
            timeout = None  # then the peer timeout
            if kind == tp_comm.STOP:
                return steps
            if kind == tp_comm.STEP:
                executor.execute(decode_step(body, fields, limits))
                steps += 1
            elif kind == tp_comm.INIT:
                raise MessageError("a second INIT message")
    except RuntimeError as exc:
        raise GroupBroken(_why(store, exc)) from exc
    finally:
        stop_children(children)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtforge tp-worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        serve_rank(args.engine_dir, args.device)
    except MessageError as exc:
        print(f"trtforge tp-worker (rank {rank}): refused a message from rank 0: {exc}; leaving the group",
              file=sys.stderr)
        return 1
    except (LaunchError, tp_auth.GroupAuthError) as exc:
        print(f"trtforge tp-worker: {exc}", file=sys.stderr)
        return 2
    except GroupBroken as exc:
        print(f"trtforge tp-worker (rank {rank}): the tensor-parallel group broke: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
