"""The Triton interface of TensorRT-LLM's models, per release trtforge records.

`upstream_<tag>.json` (next to this file, one per release in builder/trtllm/versions.py) records,
for each model of that release's `all_models/inflight_batcher_llm` and
`all_models/disaggregated_serving` (and `all_models/llmapi`): its inputs and outputs (name, type,
dims, optional, reshape, ragged), its parameter keys and the ensemble's tensor maps. Each was
extracted from the templates at the commit it names by `scripts/trtllm_facts.py`; no template is
copied. The emitter builds typed configs from the record of the release it writes for;
tests/model_repo/trtllm/ holds the same records as test data and checks what is emitted.

The parameter tables below say how each parameter is *read* (from the backend's C++ source,
inflight_batcher_llm/src/model_{state,instance_state}.cc, and the python models' `initialize`),
so that every value trtforge writes has the type its reader parses. They cover every parameter
of every recorded release; a recorded parameter they lack is an error (`kinds`), not a guess.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from trtforge.builder.trtllm.versions import TARGET, TrtllmRelease
from trtforge.model_repo.trtllm.templates import Tensor

HERE = Path(__file__).parent


def facts_file(release: TrtllmRelease) -> Path:
    return HERE / f"upstream_{release.backend_release}.json"


# Value kinds: how the reader parses the string. bool: the C++ backend takes true/false/1/0 (and
# True/TRUE); trtforge writes "true"/"false". int/float: std::stoi/stof (whole string a number).
# text: used as is. csv_ints: comma-separated ints (and `;` between instances for device lists).
# unset: trtforge writes "" on purpose; `UNSET_WHY` says why the reader takes "" as "not set".
BOOL, INT, FLOAT, TEXT, PATH, CSV_INTS, UNSET = ("bool", "int", "float", "text", "path",
                                                 "csv_ints", "unset")

TENSORRT_LLM_KINDS: dict[str, str] = {
    "FORCE_CPU_ONLY_INPUT_TENSORS": TEXT, "batch_scheduler_policy": TEXT,
    "cancellation_check_period_ms": INT, "cross_kv_cache_fraction": UNSET,
    "cuda_graph_cache_size": INT, "cuda_graph_mode": BOOL, "decoding_mode": TEXT,
    "eagle_choices": UNSET, "enable_chunked_context": BOOL, "enable_context_fmha_fp32_acc": BOOL,
    "enable_kv_cache_reuse": BOOL, "encoder_model_path": UNSET, "exclude_input_in_output": BOOL,
    "executor_worker_path": PATH, "gpt_model_path": PATH, "gpt_model_type": TEXT,
    "gpu_device_ids": CSV_INTS, "gpu_weights_percent": FLOAT, "guided_decoding_backend": UNSET,
    "iter_stats_max_iterations": INT, "kv_cache_free_gpu_mem_fraction": FLOAT,
    "enable_trt_overlap": BOOL,
    "kv_cache_host_memory_bytes": INT, "kv_cache_onboard_blocks": BOOL,
    "lookahead_ngram_size": UNSET, "lookahead_verification_set_size": UNSET,
    "lookahead_window_size": UNSET, "lora_cache_gpu_memory_fraction": FLOAT,
    "lora_cache_host_memory_bytes": INT, "lora_cache_max_adapter_size": INT,
    "lora_cache_optimal_adapter_size": INT, "lora_prefetch_dir": UNSET,
    "max_attention_window_size": CSV_INTS, "max_beam_width": INT,
    "max_tokens_in_paged_kv_cache": INT, "medusa_choices": UNSET, "multi_block_mode": BOOL,
    "normalize_log_probs": BOOL, "num_nodes": INT, "participant_ids": CSV_INTS,
    "request_stats_max_iterations": INT, "sink_token_length": INT,
    "speculative_decoding_fast_logits": BOOL, "stats_check_period_ms": INT,
    "tokenizer_dir": PATH, "xgrammar_tokenizer_info_path": UNSET,
}

PYTHON_MODEL_KINDS: dict[str, dict[str, str]] = {
    "preprocessing": {"tokenizer_dir": PATH, "add_special_tokens": BOOL, "gpt_model_path": PATH,
                      "multimodal_model_path": UNSET, "max_num_images": INT, "hf_model_path": UNSET},
    "postprocessing": {"tokenizer_dir": PATH, "skip_special_tokens": BOOL},
    "tensorrt_llm_bls": {"accumulate_tokens": BOOL, "tensorrt_llm_model_name": TEXT,
                         "tensorrt_llm_draft_model_name": UNSET,
                         "multimodal_encoders_name": UNSET},
    "disaggregated_serving_bls": {"context_model_name": TEXT, "generation_model_name": TEXT},
}

UNSET_WHY: dict[str, str] = {
    "cross_kv_cache_fraction": "std::stof('') throws, the backend leaves the fraction unset: "
                               "right for a decoder-only model (it is for encoder-decoder only)",
    "encoder_model_path": "the path '' does not exist, so the backend runs decoder-only",
    "eagle_choices": "csvStrToVecVecInt('') throws; no Eagle tree is set (not an Eagle engine)",
    "medusa_choices": "csvStrToVecVecInt('') throws; no Medusa tree is set (not a Medusa engine)",
    "guided_decoding_backend": "the backend checks for '' and builds no guided decoder",
    "xgrammar_tokenizer_info_path": "the backend checks for '' and builds no guided decoder",
    "lookahead_window_size": "only read when decoding_mode is lookahead, which it is not",
    "lookahead_ngram_size": "only read when decoding_mode is lookahead, which it is not",
    "lookahead_verification_set_size": "only read when decoding_mode is lookahead, which it is not",
    "lora_prefetch_dir": "passed to the executor as the directory to prefetch LoRA weights "
                         "from; none are (the unfilled template passes a path that does not exist "
                         "the same way). Not checked at run time here",
    "multimodal_model_path": "preprocessing treats '' as no multimodal model",
    "hf_model_path": "preprocessing (1.x) reads it only for a multimodal model (mllama, llava_onevision, "
                     "qwen2_vl, pixtral), which multimodal_model_path '' rules out",
    "tensorrt_llm_draft_model_name": "get_valid_param_value('') is None: no draft model",
    "multimodal_encoders_name": "get_valid_param_value('') is None: no multimodal encoders",
}

# The template writes these two literally (not placeholders); trtforge keeps them.
FIXED_TENSORRT_LLM = {"FORCE_CPU_ONLY_INPUT_TENSORS": "no",
                      "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/"
                                              "trtllmExecutorWorker"}


def facts(release: TrtllmRelease = TARGET) -> dict:
    """The recorded interface of `release` (see module doc)."""
    return _load(facts_file(release))


@lru_cache(maxsize=None)
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def record(release: TrtllmRelease, model: str, kind: str = "models") -> dict:
    """One model's record: kind "models" (inflight_batcher_llm, disaggregated_serving) or "llmapi"."""
    return facts(release)[kind][model]


def tensors(model: str, kind: str, release: TrtllmRelease = TARGET, group: str = "models") -> list[Tensor]:
    """`kind` ("inputs" | "outputs") of an upstream model, each name once (the ensemble of v0.19.0
    and later lists the output kv_cache_alloc_total_blocks twice; a config needs it once)."""
    seen: dict[str, Tensor] = {}
    for name, dtype, dims, optional, reshape, ragged in record(release, model, group)[kind]:
        seen.setdefault(name, Tensor(name, dtype, tuple(dims), optional,
                                     None if reshape is None else tuple(reshape), ragged))
    return list(seen.values())


def ensemble_steps(release: TrtllmRelease = TARGET) -> list[dict]:
    return record(release, "ensemble")["steps"]


def kinds(release: TrtllmRelease, model: str) -> dict[str, str]:
    """{parameter: value kind} of `model` (tensorrt_llm or a python model) at `release`, exactly its
    recorded parameter keys; ValueError for a recorded key no table above knows how to fill."""
    table = TENSORRT_LLM_KINDS if model == "tensorrt_llm" else PYTHON_MODEL_KINDS[model]
    keys = record(release, model)["parameters"]
    unknown = sorted(set(keys) - set(table))
    if unknown:
        raise ValueError(f"TensorRT-LLM {release.tensorrt_llm}'s {model} template has parameters "
                         f"trtforge does not know how to fill: {', '.join(unknown)}")
    return {k: table[k] for k in keys}


def restrict(values: dict[str, str], release: TrtllmRelease, model: str) -> dict[str, str]:
    """`values` (every release's keys) cut to `model`'s keys at `release`; each must have a value."""
    keys = kinds(release, model)
    missing = sorted(set(keys) - set(values))
    if missing:
        raise ValueError(f"no value for {model} parameters {', '.join(missing)} (TensorRT-LLM "
                         f"{release.tensorrt_llm})")
    return {k: values[k] for k in keys}
