"""`each_isa`: a test that asks for it runs once per instruction set this CPU runs (AVX-512, AVX2,
portable: plugins/native.py `supported_isas`), with every C kernel library (fused ops, packed
linear, quantized linear, decode attention) built for that ISA and swapped in for the test. So one
CI run on an AVX-512 machine checks the AVX2 and the portable code paths against their references
too, not only the machine's own."""

from __future__ import annotations

import pytest

from trtforge.plugins import native
from trtforge.plugins.cpu import fused as cpu_fused, linear as cpu_linear, quant_linear as cpu_quant
from trtforge.plugins.paged_attention import cpu_native

KERNEL_MODULES = (cpu_fused, cpu_linear, cpu_quant, cpu_native)


@pytest.fixture(params=native.supported_isas())
def each_isa(request, monkeypatch) -> str:
    for module in KERNEL_MODULES:
        lib = module.LIBRARY.for_isa(request.param).get()
        assert lib is not None, f"{module.LIBRARY.source.name} does not build for {request.param}"
        monkeypatch.setattr(module.LIBRARY, "lib", lib)
    return request.param
