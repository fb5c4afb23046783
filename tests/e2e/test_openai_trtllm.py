"""The OpenAI endpoint in front of a `--backend trtllm` repository, end to end: a tiny checkpoint
built with TensorRT-LLM, the repository for Triton's `tensorrtllm` backend, `trtforge serve
--openai-port`, the `openai` SDK. The request mapping itself is checked on CPU against the recorded
interfaces (tests/frontend/test_trtllm_frontend.py); this runs only where TensorRT-LLM, a GPU and
the tensorrtllm backend are (the NGC trtllm image, docs/tensorrt-llm.md) and is skipped elsewhere,
saying which is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import run_cli
from tests.e2e.openai_server import start_serve


def _missing() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "tensorrt_llm is not installed (run in nvcr.io/nvidia/tritonserver:25.05-trtllm-python-py3)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU: TensorRT-LLM engines run on NVIDIA GPUs only"
    if not Path("/opt/tritonserver/backends/tensorrtllm").is_dir():
        return "no tritonserver with the tensorrtllm backend (/opt/tritonserver/backends/tensorrtllm)"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(MISSING is not None, reason=f"GPU-only: {MISSING}")]
NAME = "tiny-trtllm"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-trtllm")
    run_cli("trtforge", "demo-checkpoint", str(root / "ckpt"), "--arch", "qwen2", "--size", "tiny")
    run_cli("build-engine", str(root / "ckpt"), "--backend", "trtllm", "--dtype", "float16", "--max-seq-len", "256",
            "--kv-cache-memory", "64MiB", "--output", str(root / "engine"), "-q", timeout=1800)
    run_cli("trtforge", "emit-repo", str(root / "engine"), str(root / "repo"))
    serve = start_serve(root / "repo", root / "tritonserver.log", "--served-model-name", NAME, timeout_s=600)
    try:
        yield openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=300), root
    finally:
        assert serve.stop() == 0, "".join(serve.output)


def test_seed_ignore_eos_stop_and_usage_through_tensorrt_llm(api):
    from trtforge.models.tokenizer import load_tokenizer

    client, root = api
    tok = load_tokenizer(root / "engine")
    common = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5)
    first = client.completions.create(**common, extra_body={"ignore_eos": True})
    again = client.completions.create(**common, extra_body={"ignore_eos": True})
    assert first.choices[0].text == again.choices[0].text  # the seed reached the sampler (random_seed / seed)
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"  # end_id -1
    assert first.usage.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=False))
    greedy = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    if len(greedy) >= 6:
        stop = greedy[3:6]
        cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
        assert cut.text == greedy[:greedy.index(stop)] and cut.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="top_logprobs: TensorRT-LLM .*'s ensemble has no input"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=2)
