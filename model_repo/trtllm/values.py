"""The value of every parameter of the trtllm repository's models, from the engine and our options.

Nothing is left as a `${...}` placeholder. The tables below hold the parameters of every recorded
release; each model gets exactly its release's keys (upstream.restrict). A value comes from the build (engine.json), the
scheduling options (SchedulerConfig, mapping.py), the emit options below, or — for features a
trtforge engine does not use (LoRA, speculative decoding, guided decoding, encoders) — the
backend's own default written out, or "" where the reader takes "" as "not set"
(upstream.UNSET_WHY says why for each).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtforge.builder.trtllm.versions import TrtllmRelease
from trtforge.config.fields import parse_bytes
from trtforge.model_repo.params import to_parameter
from trtforge.model_repo.trtllm import upstream as U
from trtforge.model_repo.trtllm.options import REPO_KINDS as REPO_KINDS, TrtllmOptions as TrtllmOptions
from trtforge.models.engine_dir import EngineConfig


@dataclass(frozen=True)
class TrtllmRepoOptions:
    """Options of a trtllm repository that are not SchedulerConfig fields."""

    triton_max_batch_size: int
    """max_batch_size of every model (the batch dimension a request may carry)."""
    kv_cache_memory: str
    """Memory for the paged KV cache (e.g. 4GiB); becomes max_tokens_in_paged_kv_cache."""
    exclude_input_in_output: bool = False
    """Default for requests that do not send exclude_input_in_output."""
    decoupled: bool = True
    """Decoupled tensorrt_llm and BLS models: needed for streaming (`stream: true`)."""
    kv_cache_free_gpu_mem_fraction: float = 0.9
    """Most of the free GPU memory (after loading the engine) the KV cache may take; the cache
    is the smaller of this and kv_cache_memory. 0.9: the backend's default."""
    gpu_device_ids: str = ""
    """Comma-separated GPU ids for the tensorrt_llm model ('' = every visible GPU)."""
    instance_count: int = 1
    """Instances of preprocessing, postprocessing and tensorrt_llm_bls."""
    max_queue_delay_microseconds: int = 0
    """Triton's batching delay before the tensorrt_llm model: 0, the executor batches in flight."""


@dataclass(frozen=True)
class PhaseModel:
    """One tensorrt_llm model of a disaggregated repository (upstream's context/generation)."""

    name: str
    gpu_device_ids: str
    participant_ids: str
    chunked_context: bool | None = None
    """None: from prefill_chunk_size; False: off (the generation phase prefills nothing)."""


def kv_tokens(engine: EngineConfig, kv_cache_memory: str) -> int:
    """Tokens (whole KV blocks) that `kv_cache_memory` holds for this engine."""
    per_token = engine.report.get("kv_bytes_per_token")
    if not per_token:
        raise ValueError("engine.json has no report.kv_bytes_per_token; rebuild the engine with "
                         "build-engine --backend trtllm")
    block = engine.block_size
    return parse_bytes(kv_cache_memory) // (int(per_token) * block) * block


def tensorrt_llm_parameters(engine_dir: Path, engine: EngineConfig, scheduling: Any,
                            opts: TrtllmRepoOptions, release: TrtllmRelease,
                            phase: PhaseModel | None = None) -> dict[str, str]:
    """Every parameter of the tensorrt_llm model (or of one disaggregated phase) at `release`."""
    chunked = scheduling.prefill_chunk_size > 0
    if phase is not None and phase.chunked_context is not None:
        chunked = phase.chunked_context
    values = {
        **U.FIXED_TENSORRT_LLM,
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": str(engine_dir),
        "tokenizer_dir": str(engine_dir), "max_beam_width": "1", "decoding_mode": "top_k_top_p",
        "batch_scheduler_policy": scheduling.policy,
        "enable_kv_cache_reuse": to_parameter(scheduling.enable_prefix_caching),
        "enable_chunked_context": to_parameter(chunked),
        "max_tokens_in_paged_kv_cache": str(kv_tokens(engine, opts.kv_cache_memory)),
        "kv_cache_free_gpu_mem_fraction": repr(float(opts.kv_cache_free_gpu_mem_fraction)),
        "max_attention_window_size": str(engine.max_seq_len),
        "exclude_input_in_output": to_parameter(opts.exclude_input_in_output),
        "gpu_device_ids": phase.gpu_device_ids if phase else opts.gpu_device_ids,
        "participant_ids": phase.participant_ids if phase else "",
        # The backend's defaults, written out (model_instance_state.cc).
        "sink_token_length": "0", "kv_cache_host_memory_bytes": "0",
        "kv_cache_onboard_blocks": "true", "normalize_log_probs": "true",
        "cancellation_check_period_ms": "100", "stats_check_period_ms": "100",
        "iter_stats_max_iterations": "1000", "request_stats_max_iterations": "0",
        "num_nodes": "1", "gpu_weights_percent": "1.0", "multi_block_mode": "true",
        "enable_context_fmha_fp32_acc": "false", "cuda_graph_mode": "false",
        "cuda_graph_cache_size": "0", "speculative_decoding_fast_logits": "false",
        "lora_cache_optimal_adapter_size": "8", "lora_cache_max_adapter_size": "64",
        "lora_cache_gpu_memory_fraction": "0.05", "lora_cache_host_memory_bytes": str(2**30),
        # 1.x: overlaps the host's preparation of the next step with this one (off by default in
        # model_instance_state.cc, and the python tensorrt_llm model refuses true).
        "enable_trt_overlap": "false",
    }
    values.update({key: "" for key, kind in U.TENSORRT_LLM_KINDS.items() if kind == U.UNSET})
    return U.restrict(values, release, "tensorrt_llm")


def python_model_parameters(model: str, engine_dir: Path, release: TrtllmRelease) -> dict[str, str]:
    """Parameters of preprocessing, postprocessing, tensorrt_llm_bls, disaggregated_serving_bls.

    Tokenization matches trtforge's own runtime: prompts are encoded without special tokens
    (serving/engine.py) and decoded skipping them (SamplingParams.skip_special_tokens)."""
    table = {
        "preprocessing": {"tokenizer_dir": str(engine_dir), "add_special_tokens": "false",
                          "gpt_model_path": str(engine_dir), "multimodal_model_path": "",
                          "max_num_images": "0", "hf_model_path": ""},
        "postprocessing": {"tokenizer_dir": str(engine_dir), "skip_special_tokens": "true"},
        "tensorrt_llm_bls": {"accumulate_tokens": "false",
                             "tensorrt_llm_model_name": "tensorrt_llm",
                             "tensorrt_llm_draft_model_name": "", "multimodal_encoders_name": ""},
        "disaggregated_serving_bls": {"context_model_name": "context",
                                      "generation_model_name": "generation"},
    }
    return U.restrict(table[model], release, model)
