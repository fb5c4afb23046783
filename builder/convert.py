"""Checkpoint → engine weights: apply the family's weight table, fuse, cast, stream to disk.

Two passes. The first uses only tensor metadata: every tensor the table needs must exist with
the shape the config implies — a broken checkpoint fails here, before anything is written, with
the tensor's name. The second reads, combines and writes one output tensor at a time, so peak
memory stays near one copy of the largest fused tensor (plus the checkpoint's mmap).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trtforge.builder import prequantized
from trtforge.builder.architectures import ArchSpec, WeightRule
from trtforge.builder.checkpoint import TensorReader
from trtforge.builder.hf_config import rope_layer_types
from trtforge.builder.safetensors_stream import StreamingSafetensorsWriter
from trtforge.models.errors import BuildError
from trtforge.models.model_config import ModelConfig
from trtforge.models.quantized_layers import is_quantized_weight, quantized_head_source
from trtforge.models.rope import compute_inv_freq
from trtforge.plugins.cpu.quant_linear import pack_int4, quantize


@dataclass
class Item:
    """One output tensor: our name, HF source names (shapes checked by `plan`), how to combine."""

    ours: str
    sources: list[str]
    combine: str
    shape: tuple[int, ...]


def _source_shapes(cfg: ModelConfig, rule: WeightRule, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    if rule.combine == "conv1d":
        return [tuple(reversed(shape))]
    if rule.combine == "copy":
        return [shape]
    rows = ([cfg.q_size, cfg.kv_size, cfg.kv_size] if rule.ours.startswith("attn.qkv")
            else [shape[0] // 2] * 2)  # gate | up of the MLP, an expert or the shared expert
    return [(r, *shape[1:]) for r in rows]


def plan(cfg: ModelConfig, spec: ArchSpec, reader: TensorReader,
         prequant: prequantized.SourceQuantization | None = None) -> list[Item]:
    """Every output tensor with its sources; raises BuildError for a missing or misshaped tensor.
    prequant: a pre-quantized checkpoint's scheme — its quantized linears' sources are then the HF
    `<module>.weight` names their packed tensors stand for (checked by their logical shape)."""
    from trtforge.models.network import CausalLM
    from trtforge.models.skip_init import build_on_meta

    expected = {k: tuple(v.shape) for k, v in build_on_meta(lambda: CausalLM(cfg)).state_dict().items()}
    items = []
    for rule, layer, expert in _rules(cfg, spec):
        if (rule.when and not getattr(cfg, rule.when)) or (rule.unless and getattr(cfg, rule.unless)):
            continue
        ours = rule.ours.format(e=expert) if layer is None else f"layers.{layer}.{rule.ours.format(e=expert)}"
        shape = expected[ours]
        packed = prequant is not None and is_quantized_weight(ours)
        sources = [(_find_prequantized(reader, s.format(i=layer, e=expert), spec, prequant) if packed
                    else _find(reader, s.format(i=layer, e=expert), spec)) for s in rule.sources]
        wanted = _source_shapes(cfg, rule, shape)
        for name, want in zip(sources, wanted):
            got = prequantized.logical_shape(prequant, reader, name) if packed else reader.index[name].shape
            if tuple(got) != tuple(want):
                raise BuildError(
                    f"tensor {name!r} has shape {list(got)} but the config ({cfg.architecture}: hidden "
                    f"{cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
                    f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}) implies {list(want)}. "
                    f"The weights and config.json do not belong together.")
        items.append(Item(ours, sources, rule.combine, shape))
    return items


def _rules(cfg: ModelConfig, spec: ArchSpec) -> list[tuple[WeightRule, int | None, int | None]]:
    """(rule, layer or None for a global, expert or None) for every tensor the table may produce: a layer's
    rules for its kind (dense MLP or MoE block), an expert's (`{e}`) once per routed expert."""
    out: list[tuple[WeightRule, int | None, int | None]] = [(r, None, None) for r in spec.globals]
    for i in range(cfg.num_layers):
        kind = "moe" if cfg.is_moe_layer(i) else "dense"
        for r in spec.per_layer:
            if r.layers not in ("all", kind):
                continue
            experts = range(cfg.num_experts) if "{e}" in r.ours else [None]
            out += [(r, i, e) for e in experts]
    return out


def _find(reader: TensorReader, name: str, spec: ArchSpec) -> str:
    if reader.has(name):
        return name
    for prefix in spec.hf_prefixes:
        if name.startswith(prefix) and reader.has(name[len(prefix):]):
            return name[len(prefix):]
    raise BuildError(f"the checkpoint is missing tensor {name!r}, which {spec.architecture} needs "
                     f"(files: {', '.join(sorted({i.file.name for i in reader.index.values()}))}). "
                     f"The checkpoint is incomplete or its config.json describes another model.")


def _find_prequantized(reader: TensorReader, name: str, spec: ArchSpec,
                       src: prequantized.SourceQuantization) -> str:
    """`name` (`<module>.weight`, maybe without the HF prefix) whose packed tensors the checkpoint has."""
    for candidate in [name] + [name[len(p):] for p in spec.hf_prefixes if name.startswith(p)]:
        if reader.has(prequantized.primary_tensor(src, candidate)):
            return candidate
        if reader.has(candidate) and reader.get(candidate).is_floating_point():
            raise BuildError(f"{candidate} is not quantized in this {src.format} checkpoint (its ignore / "
                             f"modules_to_not_convert list?): trtforge runs every decoder linear of a pre-quantized "
                             f"checkpoint in one scheme; layers left in float are not supported.")
    raise BuildError(f"the {src.format} checkpoint is missing {prequantized.primary_tensor(src, name)!r}, which "
                     f"{spec.architecture} needs: it is incomplete or its config.json describes another model.")


def _combine(item: Item, tensors: list[torch.Tensor]) -> torch.Tensor:
    if item.combine == "conv1d":
        return tensors[0].t()
    if item.combine == "concat":
        return torch.cat(tensors, dim=0)
    return tensors[0]


def _quantized_layout(item: Item, quant: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """`<layer>.qweight` and `<layer>.scales` in place of `<layer>.weight` (plugins/cpu/quant_linear.py);
    a pre-quantized checkpoint's also `<layer>.zeros` (zero points) and `<layer>.perm` (act-order) where the
    engine has them (models/quantized_layers.py)."""
    n, k = item.shape
    prefix = item.ours[: -len(".weight")]
    if quant["scheme"] == "int8_wo":
        out = [(f"{prefix}.qweight", torch.int8, (n, k)), (f"{prefix}.scales", torch.float32, (n,))]
        groups = 1
    else:
        groups = k // quant["group_size"]
        out = [(f"{prefix}.qweight", torch.uint8, (n, k // 2)), (f"{prefix}.scales", torch.float32, (n, groups))]
    if quant.get("zero_points"):
        out.append((f"{prefix}.zeros", torch.int8, (n, groups) if quant["scheme"] == "int4_wo" else (n,)))
    if quant.get("act_order"):
        out.append((f"{prefix}.perm", torch.int64, (k,)))
    return out


def _prequantized_outputs(item: Item, quant: dict[str, Any], src: prequantized.SourceQuantization,
                          reader: TensorReader) -> list[tuple[str, torch.Tensor]]:
    """A pre-quantized layer's tensors: the checkpoint's codes packed as ours, its scales, zeros and order."""
    lin = prequantized.read_linear(src, reader, item.sources)
    n, k = item.shape
    prefix = item.ours[: -len(".weight")]
    int4 = quant["scheme"] == "int4_wo"
    out = [(f"{prefix}.qweight", pack_int4(lin.codes) if int4 else lin.codes),
           (f"{prefix}.scales", lin.scales if int4 else lin.scales.view(n))]
    if quant.get("zero_points"):
        zeros = lin.zeros if lin.zeros is not None else torch.zeros_like(lin.scales, dtype=torch.int8)
        out.append((f"{prefix}.zeros", zeros if int4 else zeros.view(n)))
    if quant.get("act_order"):
        out.append((f"{prefix}.perm", lin.perm if lin.perm is not None else torch.arange(k)))
    return out


def _head_layout(item: Item, quant: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The quantized LM head (plugins/cpu/quant_linear.py): int8 per vocabulary row, or int4 per group."""
    return _quantized_layout(Item("head_linear.weight", item.sources, item.combine, item.shape),
                             {"scheme": quant["lm_head"], "group_size": quant.get("lm_head_group_size")})


def _layout(items: list[Item], dtype: torch.dtype, quant: dict[str, Any] | None,
            head: str | None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    layout = []
    for i in items:
        if i.ours == head:
            layout += _head_layout(i, quant)  # type: ignore[arg-type]
        elif quant and is_quantized_weight(i.ours):
            layout += _quantized_layout(i, quant)
        else:
            layout.append((i.ours, dtype, i.shape))
    return layout


def plan_with_extras(cfg: ModelConfig, spec: ArchSpec, reader: TensorReader, hf_config: Any,
                     prequant: prequantized.SourceQuantization | None = None
                     ) -> tuple[list, list[tuple[str, torch.Tensor]]]:
    """The weights to convert (plan) and the tensors computed here rather than read (RoPE's
    inverse frequencies, and the sliding layers' own where they differ (Gemma 3), whose attention
    scaling is recorded in cfg)."""
    items = plan(cfg, spec, reader, prequant)
    extra: list[tuple[str, torch.Tensor]] = []
    if cfg.position == "rope":
        global_type, local_type = rope_layer_types(hf_config)
        inv_freq, scaling = compute_inv_freq(hf_config, cfg.rope_type, cfg.rope_theta, cfg.rope_dim, global_type)
        cfg.rope_attention_scaling = scaling
        extra.append(("rope_inv_freq", inv_freq))
        if cfg.rope_local_type is not None:  # Gemma 3's sliding layers (rope_local_base_freq)
            inv_freq, scaling = compute_inv_freq(hf_config, cfg.rope_local_type, cfg.rope_local_theta or 10000.0,
                                                 cfg.rope_dim, local_type)
            cfg.rope_local_attention_scaling = scaling
            extra.append(("rope_local_inv_freq", inv_freq))
    return items, extra


def convert(cfg: ModelConfig, spec: ArchSpec, reader: TensorReader, hf_config: Any,
            dtype: torch.dtype, out: Path, progress: bool = True,
            quant: dict[str, Any] | None = None,
            prequant: prequantized.SourceQuantization | None = None) -> dict[str, int]:
    """Write rank0.safetensors; returns {"parameters": n, "weight_bytes": bytes written (quantized or
    not), "weight_bytes_unquantized": what the same weights take in `dtype`}. quant: engine.json's
    `quantization` (scheme, group_size) — the decoder's linear weights are quantized from their
    float32 values and stored with their scales — or, for a pre-quantized checkpoint (`prequant`), read
    from its packed codes as they are (builder/prequantized/)."""
    items, extra = plan_with_extras(cfg, spec, reader, hf_config, prequant)
    head = quantized_head_source(cfg, quant)
    layout = _layout(items, dtype, quant, head) + [(n, t.dtype, tuple(t.shape)) for n, t in extra]
    writer = StreamingSafetensorsWriter(out, layout, {"format": "pt", "producer": "trtforge"})
    params = written = 0
    try:
        for item in tqdm(items, desc="converting", unit="tensor", disable=not progress):
            if prequant is not None and is_quantized_weight(item.ours):
                outputs = _prequantized_outputs(item, quant, prequant, reader)  # type: ignore[arg-type]
                params += item.shape[0] * item.shape[1]
                for name, t in outputs:
                    writer.write(name, t)
                    written += t.numel() * t.element_size()
                continue
            tensor = _combine(item, [reader.get(s) for s in item.sources])
            params += tensor.numel()
            if item.ours == head:  # the LM head (a tied one: the embedding table), int8 per row or int4 per group
                parts = zip(("qweight", "scales"), quantize(tensor, quant["lm_head"],  # type: ignore[index]
                                                            quant.get("lm_head_group_size") or 0))  # type: ignore[union-attr]
                outputs = [(f"head_linear.{name}", t) for name, t in parts]
            elif quant and is_quantized_weight(item.ours):
                parts = zip(("qweight", "scales"), quantize(tensor, quant["scheme"], quant.get("group_size") or 0))
                outputs = [(f"{item.ours[: -len('.weight')]}.{name}", t) for name, t in parts]
            else:
                outputs = [(item.ours, tensor.to(dtype))]
            for name, t in outputs:
                writer.write(name, t)
                written += t.numel() * t.element_size()
            del tensor, outputs
        for name, t in extra:
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return {"parameters": params, "weight_bytes": written,
            "weight_bytes_unquantized": params * torch.empty((), dtype=dtype).element_size()}
