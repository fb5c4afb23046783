"""How an engine is *built*: limits, dtype, backend, KV budget (apart from what the model is)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trtforge.config.fields import parse_bytes
from trtforge.config.speculative import NO_SPECULATION, SpeculativeConfig, unsupported
from trtforge.models.errors import BuildError

BACKENDS = ("torch", "tensorrt", "trtllm")  # the ones that exist; `build-engine --backend` offers exactly these
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8_wo", "int4_wo")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass
class BuildConfig:
    """Options of `build-engine`; recorded in engine.json under "build"."""

    backend: str = "torch"
    """torch (runs on CPU and CUDA with trtforge's runtime) | tensorrt (ONNX + PagedAttention plugin → TensorRT
    plan; needs a GPU) | trtllm (NVIDIA TensorRT-LLM engine for Triton's tensorrtllm backend; needs its NGC image
    and a GPU)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (the checkpoint's own) | float32 | float16 | bfloat16."""
    max_batch_size: int = 64
    """Most sequences in one iteration (the decode batch limit)."""
    max_num_tokens: int = 2048
    """Most tokens (prefill chunks + decode tokens) in one iteration."""
    max_seq_len: int | None = None
    """Longest sequence (prompt + output); default: the model's max_position_embeddings (or its smallest sliding
    window, or a LongRoPE model's original_max_position_embeddings)."""
    kv_block_size: int = 16
    """Tokens per KV-cache block (page)."""
    kv_cache_memory: str = "2GiB"
    """Memory given to the paged KV cache, e.g. 4GiB; decides how many blocks exist."""
    kv_cache_dtype: str = "auto"
    """KV cache storage: auto (the model dtype) | int8 (symmetric int8 with one float32 scale per token and KV
    head, written by the attention op and dequantised when read: per token 2·layers·kv_heads·(head_dim + 4) bytes,
    so the same --kv-cache-memory holds 4D/(D+4) ≈ 3.8x the blocks of float32, 2D/(D+4) ≈ 1.9x those of
    bfloat16/float16). torch backend, CPU only."""
    quantization: str = "none"
    """Weight-only quantisation of the decoder's linear layers (fused q/k/v, o, gate/up, down): none | int8_wo
    (int8, one float32 scale per output channel) | int4_wo (int4 packed two per byte, one float32 scale per
    --group-size inputs). The LM head too, as int8 per output channel unless --lm-head-quantization int4_wo (see
    --quantize-lm-head); embeddings, norms and biases stay in --dtype. torch backend only."""
    quantize_lm_head: bool = True
    """With --quantization: store the LM head as int8 with one float32 scale per vocabulary row (for int4_wo too)
    and run it through the quantized GEMV. A tied head is the embedding table: token embeddings are then
    dequantised from the same int8 rows (no float copy is kept). --no-quantize-lm-head keeps the head (and a tied
    embedding) in --dtype."""
    lm_head_quantization: str = "int8_wo"
    """With --quantization (and the LM head quantized): int8_wo (one float32 scale per vocabulary row, the
    default) | int4_wo (int4 with one float32 scale per --group-size inputs, as ONNX Runtime GenAI's int4 models
    store theirs: half the head's bytes, ~0.07 GB less read per decode step of a 152k-vocabulary 0.5B model). A
    tied embedding is looked up in the same rows."""
    group_size: int = 128
    """Inputs sharing one int4_wo scale; must be even and divide every quantized layer's in_features (multiples
    of 8 use the C kernels)."""
    allow_pickle: bool = False
    """Accept pickled .bin weights (loaded with torch.load(weights_only=True); refused under torch < 2.6, whose
    weights_only still runs code from a crafted file: CVE-2025-32434). Off: only safetensors."""
    tp_size: int = 1
    """Tensor-parallel ranks: rank{r}.safetensors per rank, Megatron-style splits, run on torch.distributed
    (docs/scale-out.md). Torch backend, unquantized only."""
    speculative_config: str | None = None
    """The engine's default speculative decoding, vLLM's JSON object, e.g. '{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}': checked now and recorded in
    engine.json, so `trtforge generate` and the Triton model speculate unless told otherwise
    (docs/speculative-decoding.md). None or none: no default. Torch backend, tp 1."""

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["tp_size"] == 1:  # engine.json of a single-rank engine stays as it was before tensor parallelism
            del d["tp_size"]
        del d["speculative_config"]  # engine.json records it on its own (EngineConfig.speculative_config)
        return d

    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config checked on its own and against the backend and tp size (before any model is
        read); None when no default is asked for. BuildError says what is wrong."""
        text = self.speculative_config
        if text is None or text.strip().lower() == NO_SPECULATION:
            return None
        try:
            spec = SpeculativeConfig.parse(text)
        except ValueError as exc:
            raise BuildError(f"--speculative-config: {exc}") from None
        why = None if spec is None else unsupported(self.backend, self.tp_size)
        if why is not None:
            raise BuildError(f"--speculative-config ({spec.method}): speculative decoding is not supported with "
                             f"{why}. Build without --speculative-config"
                             f"{' or with --backend torch' if self.backend != 'torch' else ''}.")
        return spec

    @property
    def kv_cache_bytes(self) -> int:
        try:
            return parse_bytes(self.kv_cache_memory)
        except ValueError as exc:
            raise BuildError(str(exc)) from None

    def validate(self, max_position_embeddings: int, sliding_window: int | None,
                 rope_limit: int | None = None) -> "BuildConfig":
        """Check the options against each other and the model; fill max_seq_len. Returns self.
        rope_limit: the longest sequence the model's baked RoPE is exact for (longrope's
        original_max_position_embeddings: ModelConfig.rope_max_seq_len)."""
        if self.backend not in BACKENDS:
            raise BuildError(f"--backend {self.backend!r} is unknown: choose one of {', '.join(BACKENDS)}.")
        if self.dtype not in DTYPES:
            raise BuildError(f"--dtype {self.dtype!r} is unknown: choose one of {', '.join(DTYPES)}.")
        self.check_quantization_options()
        self.check_tp_options()
        self.check_kv_cache_dtype()
        self.speculative()
        if self.allow_pickle:  # before any file is read; checkpoint.py checks again where it unpickles
            import torch

            from trtforge.builder.checkpoint import check_pickle_safe

            check_pickle_safe(torch.__version__)
        # The torch backend's attention honours each layer's window (ModelConfig.layer_windows), so a windowed
        # model serves sequences longer than its window; the other backends cannot, so they stay capped at it.
        if self.backend == "torch":
            sliding_window = None
        limit = min(max_position_embeddings, sliding_window or max_position_embeddings)
        if self.max_seq_len is None:
            self.max_seq_len = min(limit, rope_limit or limit)
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "kv_block_size"):
            if getattr(self, name) < 1:
                raise BuildError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}.")
        if rope_limit and self.max_seq_len > rope_limit and rope_limit < limit:
            raise BuildError(f"--max-seq-len {self.max_seq_len} exceeds the model's LongRoPE "
                             f"original_max_position_embeddings ({rope_limit}): past it transformers switches to "
                             f"the long_factor frequencies, which trtforge does not implement (it bakes the "
                             f"short_factor ones). Choose --max-seq-len ≤ {rope_limit}.")
        if self.max_seq_len > limit:
            windowed = sliding_window and sliding_window < max_position_embeddings
            why = "sliding window" if windowed else "max_position_embeddings"
            raise BuildError(f"--max-seq-len {self.max_seq_len} exceeds the model's {why} ({limit}); "
                             f"choose --max-seq-len ≤ {limit}.")
        if self.max_num_tokens < self.kv_block_size:
            raise BuildError(f"contradictory limits: --max-num-tokens {self.max_num_tokens} is smaller than one "
                             f"KV block (--kv-block-size {self.kv_block_size}); raise --max-num-tokens to at least "
                             f"{self.kv_block_size} or lower --kv-block-size.")
        if self.max_num_tokens < self.max_batch_size:
            raise BuildError(f"contradictory limits: --max-num-tokens {self.max_num_tokens} < --max-batch-size "
                             f"{self.max_batch_size}: a full decode batch needs one token per sequence.")
        self.kv_cache_bytes  # noqa: B018 - a bad size raises BuildError here
        return self

    def check_quantization_options(self) -> None:
        """The quantisation options on their own and against the backend (before any model is read)."""
        if self.quantization not in QUANTIZATIONS:
            raise BuildError(f"--quantization {self.quantization!r} is unknown: "
                             f"choose one of {', '.join(QUANTIZATIONS)}.")
        if self.quantization != "none" and self.backend != "torch":
            raise BuildError(f"--quantization {self.quantization} is not supported with --backend {self.backend} yet: "
                             f"only the torch backend runs quantized weights. Build with --backend torch, or "
                             f"without --quantization.")
        if self.lm_head_quantization not in QUANTIZATIONS[1:]:
            raise BuildError(f"--lm-head-quantization {self.lm_head_quantization!r} is unknown: choose one of "
                             f"{', '.join(QUANTIZATIONS[1:])} (or --no-quantize-lm-head).")
        int4 = self.quantization == "int4_wo" or (self.quantization != "none" and self.quantize_lm_head
                                                  and self.lm_head_quantization == "int4_wo")
        if int4 and (self.group_size < 2 or self.group_size % 2):
            raise BuildError(f"--group-size {self.group_size} cannot pack int4 two per byte: choose an even "
                             f"size ≥ 2 that divides the layers' in_features (usually 128, 64 or 32).")

    def check_tp_options(self) -> None:
        """--tp-size against the backend and quantisation (the model's shapes: models/tensor_parallel.py)."""
        if self.tp_size < 1:
            raise BuildError(f"--tp-size must be ≥ 1, got {self.tp_size}.")
        if self.tp_size > 1 and self.backend != "torch":
            raise BuildError(f"--tp-size {self.tp_size} is not supported with --backend {self.backend}: trtforge's "
                             f"tensor parallelism shards the torch backend's weights only. Build with --backend torch, "
                             f"or without --tp-size.")
        if self.tp_size > 1 and self.quantization != "none":
            raise BuildError(f"--tp-size {self.tp_size} with --quantization {self.quantization} is not supported yet: "
                             f"sharded engines hold unquantized weights. Drop one of the two options.")

    def check_kv_cache_dtype(self) -> None:
        """--kv-cache-dtype on its own and against the backend (before any model is read)."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BuildError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is unknown: choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}.")
        if self.kv_cache_dtype == "int8" and self.backend != "torch":
            raise BuildError(f"--kv-cache-dtype int8 is not supported with --backend {self.backend}: its int8 "
                             f"KV pool and scales are read by trtforge's torch attention implementations only "
                             f"(not the TensorRT plugin or TensorRT-LLM). Build with --backend torch, or without "
                             f"--kv-cache-dtype.")
        if self.kv_cache_dtype == "int8" and self.tp_size > 1:
            raise BuildError(f"--kv-cache-dtype int8 with --tp-size {self.tp_size} is not supported yet: the "
                             f"tensor-parallel executor allocates float KV pools. Drop one of the two options.")

    def check_quantization_shapes(self, in_features: dict[str, int], hidden_size: int | None = None) -> None:
        """int4_wo: every quantized layer's in_features ({layer: in_features}) must split into whole groups;
        the LM head's (hidden_size) too when it is int4."""
        if self.quantize_lm_head and self.lm_head_quantization == "int4_wo" and hidden_size is not None:
            if hidden_size % 2 or hidden_size % self.group_size:
                raise BuildError(f"--lm-head-quantization int4_wo: --group-size {self.group_size} does not split the "
                                 f"LM head's in_features ({hidden_size}) into whole groups of an even size; choose "
                                 f"another --group-size or --lm-head-quantization int8_wo.")
        if self.quantization != "int4_wo":
            return
        for layer, k in in_features.items():
            if k % 2:
                raise BuildError(f"--quantization int4_wo packs two weights per byte, but {layer} has an odd "
                                 f"in_features ({k}); use int8_wo for this model.")
            if k % self.group_size:
                fits = [g for g in (256, 128, 64, 32, 16, 8) if all(v % g == 0 for v in in_features.values())]
                raise BuildError(f"--group-size {self.group_size} does not divide {layer}'s in_features ({k}); "
                                 f"choose one that divides every quantized layer "
                                 f"({', '.join(map(str, fits)) or 'no multiple of 8 does: use int8_wo'}).")
