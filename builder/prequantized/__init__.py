"""Pre-quantized checkpoints (config.json's `quantization_config`): GPTQ, AWQ and compressed-tensors.

`detect` reads the checkpoint's quantization_config into a `SourceQuantization` (refusing, by name,
what trtforge cannot run exactly); `read_linear` turns one linear layer's packed tensors into
`LinearCodes` (codes.py) — the checkpoint's own integer codes, scales and zero points in our int4 /
int8 weight-only formats, with no dequantise / re-quantise round trip (docs/quantization.md,
"Pre-quantized checkpoints"). One module per format: gptq.py, awq.py, compressed_tensors.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtforge.builder.prequantized.codes import LinearCodes, concat
from trtforge.models.errors import BuildError

FORMATS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class SourceQuantization:
    """What a checkpoint's quantization_config says, as far as trtforge uses it."""

    format: str
    """gptq | awq | compressed-tensors."""
    bits: int
    """4 (→ int4_wo) or 8 (→ int8_wo, one scale per output channel)."""
    group_size: int
    """Inputs per scale; -1: one per output channel."""
    sym: bool
    """Symmetric (no zero points) or asymmetric (a zero point per scale)."""
    desc_act: bool = False
    """GPTQ act-order: groups follow g_idx, not the input order."""
    details: dict[str, Any] = field(default_factory=dict)
    """Format specifics recorded in engine.json (GPTQ checkpoint_format, AWQ version, compressed-tensors format)."""
    ignore: tuple[str, ...] = ()
    """Module names the checkpoint keeps unquantized (must not be a decoder linear trtforge quantizes)."""

    @property
    def scheme(self) -> str:
        return "int4_wo" if self.bits == 4 else "int8_wo"

    def record(self) -> dict[str, Any]:
        """engine.json's `quantization.source_quantization` and the build report's."""
        out = asdict(self)
        del out["details"], out["ignore"]
        return {**out, **self.details}


def _module(fmt: str) -> Any:
    if fmt == "gptq":
        from trtforge.builder.prequantized import gptq

        return gptq
    if fmt == "awq":
        from trtforge.builder.prequantized import awq

        return awq
    from trtforge.builder.prequantized import compressed_tensors

    return compressed_tensors


def detect(hf_config: Any) -> SourceQuantization | None:
    """The checkpoint's pre-quantization, or None for a float checkpoint. Raises BuildError by name for a
    format or variant trtforge does not read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method") or qc.get("method") or "").lower()
    if method not in FORMATS:
        raise BuildError(f"config.json's quantization_config has quant_method {method or 'missing'!r}: trtforge reads "
                         f"pre-quantized {', '.join(FORMATS)} checkpoints (and float ones, which it can quantize "
                         f"itself with --quantization).")
    return _module(method).parse(qc)


def primary_tensor(src: SourceQuantization, weight_name: str) -> str:
    """The tensor that stands for a quantized linear's `<module>.weight` in the checkpoint (its shape check)."""
    return _module(src.format).primary_tensor(src, weight_name[: -len(".weight")])


def logical_shape(src: SourceQuantization, reader: Any, weight_name: str) -> tuple[int, int]:
    """[out_features, in_features] of the float weight a quantized linear's tensors stand for."""
    return _module(src.format).logical_shape(src, reader, weight_name[: -len(".weight")])


def read_linear(src: SourceQuantization, reader: Any, weight_names: list[str]) -> LinearCodes:
    """The codes of one of our linear layers, fused from the checkpoint's projections `weight_names`
    (e.g. q/k/v_proj.weight): stacked along the outputs."""
    mod = _module(src.format)
    return concat([mod.read(src, reader, n[: -len(".weight")]) for n in weight_names], weight_names)


__all__ = ["FORMATS", "LinearCodes", "SourceQuantization", "detect", "logical_shape", "primary_tensor", "read_linear"]
