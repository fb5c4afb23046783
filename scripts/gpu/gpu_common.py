"""Helpers shared by the scripts under scripts/gpu/ (run by scripts/device_check.sh).

They only touch trtforge through its public surfaces (the `build-engine` Click command, the demo
checkpoint writer, `LLMEngine`), so a script breaks loudly when one of those changes.
"""

from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write payload (plus the machine it ran on) as pretty JSON."""
    payload = {**payload, "environment": environment()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def environment() -> dict[str, Any]:
    """Versions and device: benchmark numbers mean nothing without them."""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextmanager
def wall_timer(device: str) -> Iterator[dict[str, float]]:
    """`with wall_timer(dev) as t: ...` then t["s"]: seconds, device work included."""
    result: dict[str, float] = {}
    sync(device)
    start = time.perf_counter()
    yield result
    sync(device)
    result["s"] = time.perf_counter() - start


def build_demo_engine(work: Path, size: str, dtype: str, build_args: list[str],
                      arch: str = "qwen2", seed: int = 0) -> tuple[Path, Path]:
    """Random-weight demo checkpoint of `size` + an engine built from it with `build-engine`.

    Returns (checkpoint dir, engine dir). `build_args` are extra `build-engine` options.
    """
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint
    from trtforge.cli.build import build_engine

    ckpt = work / f"{arch}-{size}-{dtype}-ckpt"
    engine = work / f"{arch}-{size}-{dtype}-engine"
    if not (ckpt / "config.json").exists():
        write_demo_checkpoint(ckpt, arch=arch, size=size, seed=seed, dtype=dtype)
    args = [str(ckpt), "--output", str(engine), "--force", "--quiet", "--dtype", dtype, *build_args]
    build_engine.main(args=args, standalone_mode=False)
    return ckpt, engine


def hf_greedy(model: Any, input_ids: torch.Tensor, new_tokens: int, pad_id: int) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens per row from a HF model: [B, new_tokens]."""
    attention_mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id)  # min_new_tokens keeps EOS away
    return out[:, input_ids.shape[1]:]
