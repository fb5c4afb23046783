"""The Dynamo fleet of the e2e tests (trtforge.bench.dynamo_fleet's processes), and a Dynamo runtime
in the test process that talks to the workers directly (as an attacker on the request plane would,
or as Dynamo's own router does)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from trtforge.bench.dynamo_fleet import (
    LOOPBACK,
    PLANES,
    Proc,
    Worker,
    env,
    free_port,
    get,
    start_frontend,
    start_worker,
    wait,
    wait_ready,
)

MODEL = "tiny"
MAX_TOKENS = 12
PROMPTS = ["Hello world", "The quick brown fox", "Café au lait", "Stop strings end a request;"]
__all__ = ["MODEL", "MAX_TOKENS", "PROMPTS", "oracle", "PLANES", "Proc", "Worker", "env", "free_port", "get",
           "start_frontend", "start_worker", "wait", "wait_ready", "client", "complete", "in_runtime",
           "collect"]


def oracle(engine_dir: Path):
    """The in-process engine (what `trtforge generate` runs) and its greedy text of each prompt."""
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(engine_dir)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return engine, {p: o.text for p, o in zip(PROMPTS, outs)}


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def complete(c, prompt: str, max_tokens: int, **extra) -> str:
    answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, **extra})
    return answer.choices[0].text


def in_runtime(root: Path, coroutine_fn):
    """Run `coroutine_fn(runtime)` with a Dynamo DistributedRuntime of this process on the fleet's
    discovery folder and planes (it reaches the workers' endpoints directly, no frontend)."""
    from dynamo._core import DistributedRuntime

    saved = {k: os.environ.get(k) for k in ("DYN_FILE_KV", "DYN_LOG", *LOOPBACK[:3])}
    os.environ.update({"DYN_FILE_KV": str(root / "discovery"), "DYN_LOG": "error",
                       **{k: "127.0.0.1" for k in LOOPBACK[:3]}})

    async def main():
        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        try:
            return await coroutine_fn(runtime)
        finally:
            runtime.shutdown()

    try:
        return asyncio.run(main())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def collect(stream) -> list[dict]:
    """The data of every item of a Dynamo response stream (an error item raises)."""
    return [item.data() if hasattr(item, "data") else item async for item in await stream]
