"""`emit_repo(CHECKPOINT, REPO, trtllm_repo="llmapi")`: TensorRT-LLM's LLM-API model for Triton.

    REPO/tensorrt_llm/config.pbtxt         python backend; the recorded `all_models/llmapi` interface
                                           (text_input, streaming, sampling_param_*, return_* in;
                                           text_output, finish_reason, stop_reason, KV-cache stats out)
    REPO/tensorrt_llm/1/model.yaml         the LLM(...) arguments, from trtforge's build and
                                           scheduling options, and triton_config
    REPO/tensorrt_llm/1/model.py, helpers.py   TensorRT-LLM's (copied from the image, else listed)

This is where TensorRT-LLM 1.x's Triton side is going: the model loads a Hugging Face checkpoint
with TensorRT-LLM's PyTorch backend when Triton starts, so nothing is built beforehand, and its
interface is the LLM API's, not inflight_batcher_llm's (clients send `text_input` and
`sampling_param_max_tokens` to the model `tensorrt_llm`; there is no `ensemble`).

model.yaml is written as JSON, which YAML parsers read as is. Its keys are LLM API arguments whose
names were checked against tensorrt_llm/llmapi/llm_args.py (max_batch_size, max_num_tokens,
max_seq_len, dtype, enable_chunked_prefill, kv_cache_config.{max_tokens, free_gpu_memory_fraction,
enable_block_reuse}, scheduler_config.capacity_scheduler_policy) plus every key of the release's
own model.yaml; that the LLM starts with them has not been run here (no GPU, no TensorRT-LLM).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from trtforge.builder.build_config import BuildConfig
from trtforge.builder.trtllm.versions import TrtllmRelease
from trtforge.model_repo.trtllm import upstream as U
from trtforge.model_repo.trtllm.configs import model_input, model_output

MODEL = "tensorrt_llm"
FILES = {"model.py": "../llmapi/tensorrt_llm/1/model.py",
         "helpers.py": "../llmapi/tensorrt_llm/1/helpers.py"}
"""{path under REPO/tensorrt_llm/1/: path under all_models/inflight_batcher_llm}."""
TEMPLATE = "../llmapi/tensorrt_llm/config.pbtxt"
TEMPLATE_KEY_VALUES: dict[str, Any] = {"pytorch_backend_config": {"use_cuda_graph": False}}
"""Values for keys of a release's model.yaml that trtforge has no option for (0.19's template
value: CUDA graphs off)."""


def llmapi_config(release: TrtllmRelease) -> mc.ModelConfig:
    """config.pbtxt of the LLM-API model: the recorded tensors; batching and decoupling come from
    model.yaml's triton_config (the model's auto_complete_config), as upstream's template says."""
    return mc.ModelConfig(
        name=MODEL, backend="python",
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        input=[model_input(t) for t in U.tensors(MODEL, "inputs", release, "llmapi")],
        output=[model_output(t) for t in U.tensors(MODEL, "outputs", release, "llmapi")])


def llm_arguments(model: str, build: BuildConfig, dtype: str, kv_tokens: int,
                  scheduling: Any, release: TrtllmRelease) -> dict[str, Any]:
    """model.yaml: LLM API arguments from our options, plus the release template's other keys."""
    args: dict[str, Any] = {
        "model": model, "backend": "pytorch", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
        "dtype": dtype, "max_batch_size": scheduling.max_batch_size,
        "max_num_tokens": scheduling.max_num_tokens, "max_seq_len": build.max_seq_len,
        "enable_chunked_prefill": scheduling.prefill_chunk_size > 0,
        "kv_cache_config": {"max_tokens": kv_tokens, "free_gpu_memory_fraction": 0.9,
                            "enable_block_reuse": bool(scheduling.enable_prefix_caching)},
        "scheduler_config": {"capacity_scheduler_policy": scheduling.policy.upper()},
        # Streaming needs a decoupled model; one request per Triton batch, as upstream's template.
        "triton_config": {"max_batch_size": 0, "decoupled": True},
    }
    recorded = U.record(release, MODEL, "llmapi")["model_yaml"]
    for key in recorded["keys"]:
        if key not in args:
            if key not in TEMPLATE_KEY_VALUES:
                raise ValueError(f"TensorRT-LLM {release.tensorrt_llm}'s llmapi model.yaml has a key "
                                 f"trtforge does not know how to fill: {key}")
            args[key] = TEMPLATE_KEY_VALUES[key]
    missing = sorted(set(recorded["triton_config_keys"]) - set(args["triton_config"]))
    if missing:
        raise ValueError(f"llmapi triton_config keys without a value: {', '.join(missing)}")
    return args


def model_yaml_text(args: dict[str, Any], header: list[str]) -> str:
    return "".join(f"# {h}\n" for h in header) + json.dumps(args, indent=2) + "\n"


def model_source(checkpoint: str | os.PathLike) -> str:
    """What model.yaml's `model` names: an existing directory by its absolute path, else the
    Hugging Face hub id as given (TensorRT-LLM downloads it where it runs)."""
    path = Path(checkpoint)
    return str(path.resolve()) if path.is_dir() else str(checkpoint)
