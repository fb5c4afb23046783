"""Which kernel runs where: the one registry of trtforge's compute kernels.

Each op of the network has a table keyed by (device type, dtype, ISA), the ISA being the CPU's
instruction set detected at run time ("avx512", "avx2" or "portable"; "" off the CPU). `choose`
looks every op up once for a device and dtype and returns a `Kernels`; the loader builds the
network's layers with it (models/layers.py, through `load_network(..., kernels="auto")`), so a
runtime network holds its kernels from construction on and nothing is swapped afterwards. Rows,
most specific first (ANY matches everything):

    op                 device  dtype    ISA                        choice
    linear             cpu     float32  avx512 | avx2 | portable   "cpu": packed C GEMM, any rows (cpu/linear.py)
                       any     any      any                        "torch": F.linear
    quant_linear       cpu     float32  avx512 | avx2 | portable   "cpu": the C kernels of cpu/quant_linear.c
                       any     any      any                        "torch": dequantise, then F.linear
    fused_ops          cpu     float32  avx512 | avx2 | portable   "cpu": add+RMSNorm, RoPE, SiLU·mul in C (cpu/fused.c)
                       any     any      any                        "torch": the network's own torch code
    attention          cuda    any      any                        ("triton", "cpu"): the first that imports
                       any     any      any                        ("cpu",): vectorised torch + the C decode kernel
    quant_activations  any     any      any                        "int8" (W8A8 / W4A8 where the shapes allow)

The ISA is chosen at run time (plugins/native.py `isa()`: the CPU's own, or a lower one forced
with TRTFORGE_CPU_ISA=avx2|portable) and every C library is compiled for it: -march=native for the
CPU's own ISA (AVX-512 vector types and register tiles in cpu/linear.c under `__AVX512F__`),
-march=haswell for AVX2 (AVX2/FMA intrinsics under `#ifdef __AVX2__` in quant_linear.c and
cpu_decode.c, 8-lane tiles in linear.c), the compiler's baseline for portable (plain loops; NEON on
ARM through the vector types). The registry's rows name the same kernel sources for each ISA; the
ISA shows in the engine's startup log and in every benchmark report, and tests run each kernel
against its reference under every ISA the CPU runs (tests/plugins/conftest.py `each_isa`).

The environment and an explicit override (tests) change a choice, in that order of precedence:

    override(attention=...)        > TRTFORGE_ATTENTION_IMPL=auto|reference|cpu|triton   (auto: the table)
    override(linear=...)           > TRTFORGE_CPU_ONEDNN=0 (plain F.linear, also for quantized prefill GEMMs)
    override(quant_activations=...) > TRTFORGE_QUANT_ACTIVATIONS=float (the float-activation kernels)

and availability last: no oneDNN linear in this torch -> "torch"; Triton not importable -> the next
attention in the row (an explicitly requested one raises). `TRTFORGE_CPU_NATIVE=0`, a missing compiler
or a failed build make the C libraries absent (plugins/native.py); every C path checks that per call
and runs its torch counterpart instead, so a choice of "cpu" is never wrong, only slower then.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from trtforge.plugins import native

ISAS = native.ISAS
ANY = None

ATTENTION_ENV = "TRTFORGE_ATTENTION_IMPL"
ONEDNN_ENV = "TRTFORGE_CPU_ONEDNN"
QUANT_ACTIVATIONS_ENV = "TRTFORGE_QUANT_ACTIVATIONS"
ATTENTION_IMPLS = ("auto", "reference", "cpu", "triton")
"""Names an attention choice may take: "auto" is the table's row, the others force one implementation."""

_F32 = torch.float32
_C_KERNELS = {("cpu", _F32, isa): "cpu" for isa in ISAS}
REGISTRY: dict[str, dict[tuple[str | None, torch.dtype | None, str | None], Any]] = {
    "linear": {**_C_KERNELS, (ANY, ANY, ANY): "torch"},
    "quant_linear": {**_C_KERNELS, (ANY, ANY, ANY): "torch"},
    "fused_ops": {**_C_KERNELS, (ANY, ANY, ANY): "torch"},
    "attention": {("cuda", ANY, ANY): ("triton", "cpu"), (ANY, ANY, ANY): ("cpu",)},
    "quant_activations": {(ANY, ANY, ANY): "int8"},
}
CHOICES = {"linear": ("cpu", "torch"), "quant_linear": ("cpu", "torch"), "fused_ops": ("cpu", "torch"),
           "attention": ATTENTION_IMPLS, "quant_activations": ("int8", "float")}

_overrides: dict[str, str] = {}


def detect_isa() -> str:
    """The ISA the CPU kernels are built for in this process (plugins/native.py `isa()`: the
    CPU's own, or a lower one forced by TRTFORGE_CPU_ISA)."""
    return native.isa()


def lookup(op: str, device: str, dtype: torch.dtype | None, isa: str = "") -> Any:
    """The table's entry of `op` for this key: the most specific row that matches."""
    table = REGISTRY[op]
    for key in ((device, dtype, isa), (device, dtype, ANY), (device, ANY, ANY), (ANY, ANY, ANY)):
        if key in table:
            return table[key]
    raise KeyError(f"no {op} kernel registered for {device}/{dtype}/{isa}")  # the ANY row exists


@dataclass(frozen=True)
class Kernels:
    """The kernels chosen for one device and dtype: what the network's layers are built with."""

    device: str
    dtype: torch.dtype | None
    isa: str
    linear: str = "torch"
    quant_linear: str = "torch"
    fused_ops: str = "torch"
    quant_activations: str = "int8"
    attention: tuple[str, ...] | None = None
    """Attention implementations in order of preference (the first available one runs); None: the op
    decides per call (plugins/paged_attention/op.py resolve_impl), as traced and exported graphs need."""

    def describe(self, attention_resolved: str | None = None) -> str:
        """One line for the startup log; attention_resolved: the implementation the preference gave."""
        where = " ".join(p for p in (self.device, str(self.dtype).removeprefix("torch."), self.isa) if p)
        attention = "per call" if self.attention is None else "|".join(self.attention)
        if attention_resolved is not None and (attention_resolved,) != self.attention:
            attention += f" -> {attention_resolved}"
        return (f"kernels for {where}: linear {self.linear}, quantized linear {self.quant_linear} "
                f"({self.quant_activations} activations), fused ops {self.fused_ops}, attention {attention}")


REFERENCE = Kernels(device="", dtype=None, isa="")
"""Plain torch everywhere: the network export and conversion trace (`CausalLM(cfg)`'s default)."""


def _setting(op: str, env_value: str | None) -> str | None:
    """The override of `op`, else the environment's value, else None (the table's)."""
    return _overrides.get(op) or env_value or None


def attention_preference(device: str, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The attention implementations to try in order, for tensors on `device`."""
    name = _setting("attention", os.environ.get(ATTENTION_ENV)) or "auto"
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"{ATTENTION_ENV}={name!r} is not an attention implementation; "
                         f"set it to one of {ATTENTION_IMPLS} or unset it")
    if name != "auto":
        return (name,)
    return lookup("attention", device, dtype, detect_isa() if device == "cpu" else "")


def choose(device: str | torch.device, dtype: torch.dtype) -> Kernels:
    """The kernels for a network on `device` computing in `dtype`: the table, the environment, the
    overrides, then availability (module docstring)."""
    device = torch.device(device).type
    isa = detect_isa() if device == "cpu" else ""
    linear = _setting("linear", "torch" if os.environ.get(ONEDNN_ENV, "1") == "0" else None) \
        or lookup("linear", device, dtype, isa)
    if linear == "cpu":
        from trtforge.plugins.cpu.linear import onednn_available

        linear = "cpu" if onednn_available() else "torch"
    float_env = "float" if os.environ.get(QUANT_ACTIVATIONS_ENV, "int8") == "float" else None
    return Kernels(
        device=device, dtype=dtype, isa=isa, linear=linear,
        quant_linear=_setting("quant_linear", None) or lookup("quant_linear", device, dtype, isa),
        fused_ops=_setting("fused_ops", None) or lookup("fused_ops", device, dtype, isa),
        quant_activations=_setting("quant_activations", float_env) or lookup("quant_activations", device, dtype, isa),
        attention=attention_preference(device, dtype))


@contextlib.contextmanager
def override(**choices: str | None) -> Iterator[None]:
    """Force choices while the block runs, above the environment: e.g. override(attention="reference")
    for the op's calls and for networks built meanwhile (tests). A value None removes an override."""
    for op, value in choices.items():
        if op not in CHOICES:
            raise ValueError(f"unknown kernel op {op!r}; choose one of {tuple(CHOICES)}")
        if value is not None and value not in CHOICES[op]:
            raise ValueError(f"unknown {op} implementation {value!r}; choose one of {CHOICES[op]}")
    saved = dict(_overrides)
    for op, value in choices.items():
        if value is None:
            _overrides.pop(op, None)
        else:
            _overrides[op] = value
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


__all__ = ["ATTENTION_IMPLS", "ISAS", "Kernels", "REFERENCE", "REGISTRY", "attention_preference", "choose",
           "detect_isa", "lookup", "override"]
