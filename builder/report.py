"""The build report: what the engine costs in memory and how much KV the budget holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trtforge.builder.build_config import BuildConfig
from trtforge.models.kv_sizing import kv_bytes_per_token, kv_num_blocks
from trtforge.models.model_config import ModelConfig


@dataclass
class BuildReport:
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_num_blocks: int
    kv_tokens: int
    """Tokens the KV budget holds (whole blocks)."""
    full_length_sequences: int
    """How many max_seq_len sequences fit at once (what a non-paged cache could serve)."""
    build_seconds: float = 0.0
    peak_rss_bytes: int = 0
    quantization: str | None = None
    """Weight-only scheme of the decoder's linear layers, or None."""
    weight_bytes_unquantized: int = 0
    """What the same weights take unquantized, in the engine dtype (= weight_bytes when not quantized)."""
    kv_cache_dtype: str = ""
    """int8 (--kv-cache-dtype int8: int8 values + float32 scales per token and head), or the model dtype."""
    family: str = ""
    """The weight-table family (ModelConfig.family), e.g. mixtral."""
    source_quantization: dict | None = None
    """A pre-quantized checkpoint's scheme (format gptq | awq | compressed-tensors, bits, group_size, sym,
    desc_act, and the format's own fields), whose codes the engine keeps; None for a float checkpoint."""
    moe: dict | None = None
    """Mixture-of-Experts models: num_experts, top_k, renormalised, moe_layers (how many of num_layers),
    expert_intermediate_size, shared_expert_intermediate_size; None for a dense model."""

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        gib = 2**30
        return [
            f"parameters            {self.parameters:,}",
            f"weights               {self.weight_bytes / gib:.3f} GiB" + (
                f" ({self.quantization}; {self.weight_bytes_unquantized / gib:.3f} GiB before, "
                f"{self.weight_bytes_unquantized / max(self.weight_bytes, 1):.2f}x smaller)"
                if self.quantization else ""),
            f"KV per token          {self.kv_bytes_per_token / 1024:.1f} KiB" + (
                " (int8 + float32 scale per token and head)" if self.kv_cache_dtype == "int8" else ""),
            f"KV budget             {self.kv_cache_bytes / gib:.3f} GiB = {self.kv_num_blocks:,} blocks "
            f"= {self.kv_tokens:,} tokens",
            f"full-length sequences {self.full_length_sequences:,} (paged: any mix of shorter ones fits)",
            f"build time            {self.build_seconds:.1f} s, peak RSS {self.peak_rss_bytes / gib:.2f} GiB",
            *self._source_lines(),
            *self._moe_lines(),
        ]

    def _source_lines(self) -> list[str]:
        s = self.source_quantization
        if not s:
            return []
        group = "per channel" if s["group_size"] == -1 else f"group {s['group_size']}"
        return [f"pre-quantized ({self.family}) {s['format']} {s['bits']}-bit, {group}, "
                f"{'symmetric' if s['sym'] else 'asymmetric (zero points)'}"
                f"{', act-order' if s['desc_act'] else ''}: the checkpoint's codes as {self.quantization}"]

    def _moe_lines(self) -> list[str]:
        m = self.moe
        if not m:
            return []
        shared = (f"; a shared expert of {m['shared_expert_intermediate_size']}"
                  if m["shared_expert_intermediate_size"] else "")
        return [f"experts ({self.family})  {m['num_experts']} per MoE layer, top-{m['top_k']}"
                f"{' renormalised' if m['renormalised'] else ''}, {m['expert_intermediate_size']} wide; "
                f"MoE in {m['moe_layers']} of {m['num_layers']} layers{shared}"]


def make_report(cfg: ModelConfig, build: BuildConfig, dtype: str, parameters: int,
                weight_bytes: int, quantization: str | None = None, weight_bytes_unquantized: int = 0,
                source_quantization: dict | None = None) -> BuildReport:
    kv_dtype = getattr(build, "kv_cache_dtype", "auto")
    per_token = kv_bytes_per_token(cfg, dtype, kv_dtype)
    blocks = kv_num_blocks(cfg, dtype, build.kv_block_size, build.kv_cache_bytes, kv_dtype)
    tokens = blocks * build.kv_block_size
    return BuildReport(parameters=parameters, weight_bytes=weight_bytes, kv_bytes_per_token=per_token,
                       kv_cache_bytes=build.kv_cache_bytes, kv_num_blocks=blocks, kv_tokens=tokens,
                       full_length_sequences=tokens // int(build.max_seq_len or 1), quantization=quantization,
                       weight_bytes_unquantized=weight_bytes_unquantized or weight_bytes,
                       kv_cache_dtype="int8" if kv_dtype == "int8" else dtype, family=cfg.family, moe=_moe(cfg),
                       source_quantization=source_quantization)


def _moe(cfg: ModelConfig) -> dict | None:
    if not cfg.num_experts:
        return None
    return {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "renormalised": cfg.norm_topk_prob,
            "moe_layers": sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), "num_layers": cfg.num_layers,
            "expert_intermediate_size": cfg.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
