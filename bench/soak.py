"""`trtforge bench soak`: a bounded soak of a real tritonserver on loopback.

    tiny demo engine (built once in --work-dir) ──▶ emit-repo ──▶ tritonserver (free ports)
    N planned requests (soak_workload) ──▶ --concurrency workers ──▶ outcome per request
    every checkpoint: stop sending, let the server go idle ──▶ memory of its process tree + gauges

Checked requests are greedy and compared with the same engine run in this process; cut ones are
cancelled or disconnected mid-stream; malformed ones must be refused (see soak_workload). The run
fails when a text differs, a request errs unexpectedly, a malformed one is served, or the server
is not idle (KV blocks, running or waiting requests left) after a checkpoint. Memory growth is
reported, not judged: what is acceptable depends on the allocator and the run length.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import click

from trtforge.bench import soak_report as R
from trtforge.bench.soak_clients import Clients, Outcome, send
from trtforge.bench.soak_config import SoakConfig
from trtforge.bench.soak_probe import read_metrics, tree_memory, wait_idle
from trtforge.bench.soak_workload import CHECKED_KINDS, CHECKED_MAX_TOKENS, PROMPTS, Planned, expected_texts, make_plan

BUILD_FLAGS = ("--dtype", "float32", "--max-batch-size", "32", "--max-num-tokens", "256",
               "--max-seq-len", "256", "--kv-block-size", "8", "--kv-cache-memory", "8MiB")
"""build-engine flags of the soak's tiny engine (the e2e tests' engine)."""


# -- setup ------------------------------------------------------------------------------------
def _cli(*args: str) -> None:
    exe = Path(sys.executable).parent / args[0]
    proc = subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise click.ClickException(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def prepare(cfg: SoakConfig) -> tuple[Path, Path]:
    """(engine dir, repository): the engine is built unless one built with BUILD_FLAGS is there."""
    from trtforge.model_repo.emit import emit_repo  # protobuf, tritonclient

    work = cfg.work_path()
    engine, stamp = work / "engine", work / "engine.flags"
    if cfg.rebuild or not (engine / "engine.json").is_file() or \
            not stamp.is_file() or stamp.read_text() != " ".join(BUILD_FLAGS):
        _cli("trtforge", "demo-checkpoint", str(work / "checkpoint"), "--arch", "qwen2", "--size", "tiny")
        _cli("build-engine", str(work / "checkpoint"), "--output", str(engine), "--force", "-q", *BUILD_FLAGS)
        stamp.write_text(" ".join(BUILD_FLAGS))
    repo = emit_repo(engine, work / "repo")
    if cfg.model_file:
        (repo / "ensemble" / "1" / "model.py").write_text(Path(cfg.model_file).read_text())
    return engine, repo


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """Set `extra` in os.environ for the duration (the server inherits it when it starts)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- the run ----------------------------------------------------------------------------------
async def _round(clients: Clients, todo: list[Any], concurrency: int, deadline: float,
                 outcomes: list[Outcome]) -> None:
    """Send `todo` from `concurrency` workers; none starts a request after `deadline`."""
    queue = iter(todo)

    async def worker() -> None:
        for planned in queue:  # one iterator shared by the workers (one thread: no lock)
            if time.monotonic() > deadline:
                return
            outcomes.append(await send(clients, planned))
            if len(outcomes) % 500 == 0:
                print(f"  {len(outcomes)} requests done", file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _checkpoint(server: Any, cfg: SoakConfig, done: int, started: float) -> dict[str, Any]:
    idle, waited, metrics = wait_idle(server.metrics_url, cfg.idle_timeout_s)
    time.sleep(0.5)  # let the response thread and Triton release what the last answers held
    return {"requests": done, "elapsed_s": time.monotonic() - started, "idle": idle,
            "idle_wait_s": waited, "metrics": metrics, "memory": tree_memory(server.process.pid)}


async def drive(server: Any, cfg: SoakConfig, plan: list[Any], expected: dict) -> dict[str, Any]:
    """Open the clients, warm up, then send the plan round by round; outcomes and checkpoints."""
    import aiohttp  # optional dependency (tritonclient[http])
    import tritonclient.grpc.aio as grpcclient

    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cfg.concurrency)) as http:
            clients = Clients(grpc, http, server.http_url, expected, cfg.request_timeout_s)
            await _warm_up(clients, cfg)
            return await _rounds(server, cfg, plan, clients)
    finally:
        await grpc.close()


async def _warm_up(clients: Clients, cfg: SoakConfig) -> None:
    """Unmeasured checked requests: open the connections, load the lazy paths."""
    warm = [Planned(-1 - i, CHECKED_KINDS[i % len(CHECKED_KINDS)], PROMPTS[i % len(PROMPTS)],
                    CHECKED_MAX_TOKENS[0]) for i in range(2 * cfg.concurrency)]
    out: list[Outcome] = []
    await _round(clients, warm, cfg.concurrency, time.monotonic() + 300, out)
    if not any(o.outcome in ("ok", "mismatch") for o in out):  # the server answers at all
        raise click.ClickException(f"no warm-up request was answered: {out[0].detail if out else ''}")


async def _rounds(server: Any, cfg: SoakConfig, plan: list[Any], clients: Clients) -> dict[str, Any]:
    outcomes: list[Outcome] = []
    started = time.monotonic()
    checkpoints = [_checkpoint(server, cfg, 0, started)]
    deadline, last = started + cfg.max_seconds, 0
    for mark in cfg.checkpoint_list():
        await _round(clients, plan[last:mark], cfg.concurrency, deadline, outcomes)
        last = mark
        checkpoints.append(_checkpoint(server, cfg, len(outcomes), started))
        if time.monotonic() > deadline:
            break
    return {"outcomes": outcomes, "checkpoints": checkpoints, "wall_s": time.monotonic() - started}


def stop_hint(log: Path) -> str:
    """What tritonserver logged while stopping: why it gave up, if it did."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    tail = text[text.rfind("Signal (15) received."):] if "Signal (15) received." in text else ""
    live = re.findall(r"Timeout \d+: Found \d+ live models[^\"\n]*", tail)
    hints = live[-1:]
    if "Signal (11) received." in tail:
        hints.append("it crashed (SIGSEGV) while stopping")
    return "; ".join(hints) or "see the server log"


def summarize(cfg: SoakConfig, env: dict[str, str], run: dict[str, Any], exit_code: int | None) -> dict[str, Any]:
    outcomes = run["outcomes"]
    rows = [R.memory_row(cp) for cp in run["checkpoints"]]
    bad = [o for o in outcomes if o.outcome in R.FAILURES]
    problems = [f"{len(bad)} failed requests, e.g. " + "; ".join(
        f"#{o.index} {o.kind}/{o.variant or '-'}: {o.outcome} {o.detail}" for o in bad[:5])] if bad else []
    problems += [f"not idle after {r['requests']} requests: {r}" for r in rows if not r["idle"]]
    if exit_code != 0:  # e.g. a model Triton could not unload: something still holds a request of it
        log = cfg.work_path() / "tritonserver.log"
        problems.append(f"tritonserver exited with code {exit_code} when stopped ({stop_hint(log)}; log: {log})")
    n = len(outcomes)
    return {"config": dataclasses.asdict(cfg), "server_env": env, "requests_sent": n,
            "wall_s": run["wall_s"], "outcomes": R.outcome_counts(outcomes), "malformed": R.refusals(outcomes),
            "checkpoints": rows, "growth_per_1k": R.growth(rows), "latency": R.latency(outcomes, 0, n, 1000),
            "server_exit_code": exit_code, "passed": not problems, "problems": problems,
            "checkpoint_details": run["checkpoints"],
            "requests": [[o.index, o.kind, o.variant, o.outcome, round(o.latency_s, 4), o.pieces, o.status]
                         for o in outcomes]}


def run_soak(cfg: SoakConfig, env: dict[str, str]) -> dict[str, Any]:
    """Prepare, serve, soak, stop; the report."""
    from trtforge.model_repo.launcher import TritonServer

    engine, repo = prepare(cfg)
    plan = make_plan(cfg.num_requests, cfg.seed)
    log = cfg.work_path() / "tritonserver.log"
    log.unlink(missing_ok=True)  # the launcher appends; this run's log only
    server = TritonServer(repo, log_file=log)
    with environ(env):
        server.start()
    try:
        expected = expected_texts(str(engine))  # the oracle runs while the server loads
        server.wait_ready(timeout_s=300)
        run = asyncio.run(drive(server, cfg, plan, expected))
        run["checkpoints"][-1]["final_metrics"] = read_metrics(server.metrics_url)
    finally:
        code = server.stop()
    return summarize(cfg, env, run, code)

