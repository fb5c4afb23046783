"""Ranks > 0 of a tensor-parallel engine: receive each step from rank 0, run this rank's shard.

    python -m trtforge.serving.worker.tp_worker ENGINE_DIR [--device cpu|cuda]   (= trtforge tp-worker)

with the launch in torchrun's environment variables (tp_launch.py): RANK/WORLD_SIZE for one
process per rank, or NNODES/NODE_RANK for a host whose first process starts the host's others.
Rank 0 starts its own host's ranks this way; on another host this is the command to run. It
holds no scheduler and no sampler: it loops on rank 0's messages until STOP, and exits with an
error when rank 0 goes away (a closed connection, or no message within the group's timeout).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from trtforge.models.engine_dir import read_engine_config
from trtforge.serving.worker import tp_comm
from trtforge.serving.worker.tp_launch import (
    THREADS_ENV,
    LaunchError,
    launch_from_env,
    open_store,
    spawn_ranks,
    stop_children,
)
from trtforge.serving.worker.tp_rank import cpu_threads, load_rank, rank_device


def serve_rank(engine_dir: str, device: str = "cpu") -> int:
    """Run this process's rank until rank 0 says STOP; returns the steps run."""
    cfg = read_engine_config(engine_dir)
    launch = launch_from_env(cfg.tp_size)
    if launch.rank == 0:
        raise LaunchError("this process would be rank 0 (RANK=0 or NODE_RANK=0): rank 0 runs `trtforge generate`, "
                          "`trtforge bench offline` or the Triton model, which start or wait for the other ranks; "
                          "`trtforge tp-worker` runs ranks > 0.")
    dev = rank_device(device, launch.local_rank)
    threads = cpu_threads(launch) if dev.type == "cpu" and (launch.spawn or os.environ.get(THREADS_ENV)) else None
    if threads:
        torch.set_num_threads(threads)
    children = spawn_ranks(launch, engine_dir, device, threads)
    try:
        store = open_store(launch)
        store.set(f"ready/{launch.rank}", "1")
        tp_comm.join_group(store, launch.rank, launch.world_size, dev)
        kind, fields, _ = tp_comm.receive(dev)
        if kind != tp_comm.INIT:
            raise RuntimeError(f"rank {launch.rank}: expected the INIT message from rank 0, got kind {kind}")
        num_blocks, identity = fields[0], fields[1]
        if identity != tp_comm.engine_identity(cfg):
            raise LaunchError(f"rank {launch.rank} loaded {engine_dir}, whose files differ from rank 0's engine: "
                              "every host needs a copy of the same engine directory.")
        executor, _ = load_rank(engine_dir, cfg, launch.rank, num_blocks, dev)
        steps = 0
        while True:
            kind, fields, body = tp_comm.receive(dev)
            if kind == tp_comm.STOP:
                return steps
            if kind == tp_comm.STEP:
                executor.execute(tp_comm.decode_step(body, fields))
                steps += 1
    finally:
        stop_children(children)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtforge tp-worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        serve_rank(args.engine_dir, args.device)
    except LaunchError as exc:
        print(f"trtforge tp-worker: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # rank 0 went away: a closed connection or the group's timeout
        print(f"trtforge tp-worker (rank {os.environ.get('RANK', '?')}): the tensor-parallel group broke: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
