"""The CPU linear layer (plugins/cpu/linear.py): the packed C GEMM, built for every ISA this CPU runs
(AVX-512, AVX2, portable), against F.linear in float64 on shapes that leave remainders everywhere:
rows not a multiple of the register tile, N not a multiple of a panel pair, K not a multiple of
the vector width, more rows than one chunk with K past one K block, more tiles than one column
block, 1 to 3 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtforge.plugins import native
from trtforge.plugins.cpu import linear as cpu_linear
from trtforge.plugins.cpu.linear import CpuLinear, PackedEmbedding


@pytest.fixture(params=native.supported_isas())
def lib(request):
    """linear.c built for one ISA (each a separate library in this process)."""
    built = cpu_linear.LIBRARY.for_isa(request.param).get()
    assert built is not None, f"linear.c does not build for {request.param}"
    return built


def _reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_every_isa_this_cpu_runs_is_tested():
    assert native.supported_isas()[0] == native.detected_isa() and native.supported_isas()[-1] == "portable"


@pytest.mark.parametrize("n,k", [(18, 40), (50, 37), (64, 8), (1, 300)])
def test_pack_matches_the_reference_layout_and_unpacks(lib, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    packed = cpu_linear.pack(w, lib)
    assert packed.shape == cpu_linear.packed_shape(n, k) and packed.shape[0] % 2 == 0
    assert torch.equal(packed, cpu_linear.pack_reference(w))
    assert torch.equal(cpu_linear.unpack(packed, n), w)
    assert torch.count_nonzero(packed.transpose(1, 2).reshape(-1, k)[n:]) == 0  # padding rows are zero


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 16, 17, 63, 64, 97, 200])
@pytest.mark.parametrize("n,k", [(18, 40), (50, 300), (96, 33)])
def test_packed_linear_matches_f_linear(lib, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_linear.packed_linear(x, cpu_linear.pack(w, lib), b, n, lib)
    torch.testing.assert_close(got, _reference(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows", [8, 9, 23, 24, 25, 72, 73, 96, 97, 193])
@pytest.mark.parametrize("n,k", [(517, 129), (40, 257)])
def test_packed_linear_blocking_edges(lib, rows, n, k, threads):
    """Every edge of the blocked path: rows at and past DIRECT_ROWS and each ISA's chunk (MC: 24,
    72, 96 rows), K one past a K block (balanced blocks), more tiles than one column block (517
    columns: 17 tiles of 32, 33 of 16) with a partial last one, and more threads than work units."""
    g = torch.Generator().manual_seed(rows * 7 + n + threads)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_linear.pack(w, lib)
    y = torch.full((rows, n), float("nan"))
    lib.trtforge_packed_linear(x.data_ptr(), rows, packed.data_ptr(), b.data_ptr(), y.data_ptr(), n, k, threads)
    torch.testing.assert_close(y, _reference(x, w, b), atol=1e-4, rtol=1e-5)


def test_a_layer_packs_at_load_and_drops_its_dense_weight():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(18, 40, generator=g), torch.randn(18, generator=g), torch.randn(2, 3, 40, generator=g)
    layer = CpuLinear(w, b)
    with torch.inference_mode():
        dense = layer(x)  # before packing: oneDNN on the dense weight
    layer.pack_weights()
    assert layer.weight is None and layer.packed is not None and "packed" in repr(layer)
    assert "weight" not in layer.state_dict() and "packed" not in layer.state_dict()
    with torch.inference_mode():
        packed = layer(x)
    torch.testing.assert_close(packed, _reference(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dense, _reference(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x), _reference(x, w, b), atol=1e-4, rtol=1e-5)  # grad mode: F.linear
    assert torch.equal(layer.dense_weight(), w)


def test_packed_embedding_reads_the_tables_rows_and_refuses_bad_ids():
    from trtforge.models.layers import TiedLMHead

    table = torch.nn.Embedding(50, 24)
    with torch.no_grad():
        table.weight.copy_(torch.randn(50, 24, generator=torch.Generator().manual_seed(1)))
    expected = table.weight.detach().clone()
    head = TiedLMHead(table, None, cpu_linear.cpu_linear)
    head.pack_weights()
    embedding = PackedEmbedding(head)
    ids = torch.tensor([[0, 49, 17], [16, 15, 32]])
    assert torch.equal(embedding(ids), expected[ids])
    out = torch.empty(3, 24)
    assert embedding(ids[0], out=out).data_ptr() == out.data_ptr() and torch.equal(out, expected[ids[0]])
    for bad in (50, -1):
        with pytest.raises(IndexError, match="out of range"):
            embedding(torch.tensor([1, bad]))


def test_forced_isa(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "portable")
    assert native.isa() == "portable"
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="TRTFORGE_CPU_ISA"):
        native.isa()
    monkeypatch.delenv(native.ISA_ENV)
    assert native.isa() == native.detected_isa()
    assert native.isa_flags(native.detected_isa()) == ("-march=native",)


@pytest.mark.parametrize("shape", [(33, 40), (2, 35, 40), (64, 40)])
def test_onednn_rows_padded_to_a_few_shapes(shape):
    """Rows reach oneDNN (the unpacked fallback) padded to a multiple of ONEDNN_ROW_QUANTUM (one
    cached kernel per padded count, not per count); the result is F.linear's, in the input's shape."""
    from trtforge.plugins.cpu.linear import onednn_linear

    g = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(*shape, generator=g), torch.randn(18, 40, generator=g), torch.randn(18, generator=g)
    y = onednn_linear(x, w, b)
    assert y.shape == (*shape[:-1], 18)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_each_isa_is_its_own_binary():
    """The ISA is a build of its own (flags in the cache key), not one library loaded three times."""
    built = {isa: native.build(cpu_linear.LIBRARY.source, cpu_linear.LIBRARY.extra_flags, isa)
             for isa in native.supported_isas()}
    assert len({p.read_bytes() for p in built.values()}) == len(built)
