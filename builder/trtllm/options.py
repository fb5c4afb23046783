"""trtforge's build options → TensorRT-LLM's: one pure function, tested on its own.

TensorRT-LLM builds an engine from a `tensorrt_llm.BuildConfig` (limits) whose `plugin_config`
decides the attention path. What trtforge asks of every engine, and how it says so there:

  paged KV cache            plugin_config.paged_kv_cache = True (BuildConfig turns it into
                            kv_cache_type PAGED)
  in-flight batching        plugin_config.remove_input_padding = True (packed tokens: prefill
                            chunks and decode tokens of many sequences in one step)
  chunked prefill, KV reuse plugin_config.use_paged_context_fmha = True (context FMHA reading
                            the paged cache), context_fmha = True
  KV block = our block      plugin_config.tokens_per_block = --kv-block-size (a power of 2)

and our limits map one to one: max_batch_size, max_num_tokens, max_seq_len; max_input_len is
max_seq_len - 1, the longest prompt that still leaves room for one generated token (our
scheduler's rule). Beam search is not offered: max_beam_width = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtforge.builder.build_config import BuildConfig
from trtforge.models.errors import BuildError

TRTLLM_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class TrtllmBuildOptions:
    """Everything trtforge passes to TensorRT-LLM for one build (see module doc)."""

    dtype: str
    """`LLM(dtype=...)`: the engine's weight/activation dtype (trtforge's resolved --dtype)."""
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    max_input_len: int
    """Longest prompt: max_seq_len - 1."""
    max_beam_width: int = 1
    plugin: dict[str, Any] = field(default_factory=dict)
    """Attributes set on BuildConfig.plugin_config (paged KV, packed input, paged context FMHA,
    tokens_per_block)."""
    kv_cache_max_tokens: int = 0
    """KvCacheConfig.max_tokens of the executor the LLM API starts after building: the tokens our
    --kv-cache-memory holds, so the build does not claim 90 % of the GPU for a cache it drops."""

    def build_config_kwargs(self) -> dict[str, int]:
        """Keyword arguments of tensorrt_llm's BuildConfig."""
        d = asdict(self)
        return {k: d[k] for k in ("max_batch_size", "max_num_tokens", "max_seq_len",
                                  "max_input_len", "max_beam_width")}


def check_block_size(kv_block_size: int) -> None:
    """TensorRT-LLM's paged KV cache takes only power-of-2 blocks (tokens_per_block)."""
    if not (kv_block_size > 0 and kv_block_size & (kv_block_size - 1) == 0):
        raise BuildError(f"--backend trtllm: --kv-block-size {kv_block_size} is not a power of 2, "
                         "which TensorRT-LLM's paged KV cache (tokens_per_block) requires; use e.g. "
                         "16, 32 or 64.")


def trtllm_build_options(build: BuildConfig, dtype: str, kv_tokens: int) -> TrtllmBuildOptions:
    """TensorRT-LLM options for a validated `build` (max_seq_len filled), the resolved `dtype`
    and the number of tokens its KV budget holds. BuildError for what TensorRT-LLM cannot build."""
    if dtype not in TRTLLM_DTYPES:
        raise BuildError(f"--backend trtllm: dtype {dtype!r} is not one TensorRT-LLM builds "
                         f"({', '.join(TRTLLM_DTYPES)}); pass --dtype float16 or bfloat16.")
    check_block_size(build.kv_block_size)
    if build.max_seq_len is None or build.max_seq_len < 2:
        raise BuildError("--backend trtllm: --max-seq-len must be at least 2 (one prompt token and "
                         "one generated token).")
    plugin = {"paged_kv_cache": True, "remove_input_padding": True, "context_fmha": True,
              "use_paged_context_fmha": True, "tokens_per_block": build.kv_block_size}
    return TrtllmBuildOptions(dtype=dtype, max_batch_size=build.max_batch_size,
                              max_num_tokens=build.max_num_tokens, max_seq_len=build.max_seq_len,
                              max_input_len=build.max_seq_len - 1, plugin=plugin,
                              kv_cache_max_tokens=kv_tokens)
