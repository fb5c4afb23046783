"""KV pools read as zeros without being written, and pools do not share memory."""

from __future__ import annotations

import torch

from trtforge.serving.worker.kv_pool import zeroed_pool


def test_cpu_pool_is_zero_writable_and_separate():
    shape = (2, 64, 16, 2, 8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = zeroed_pool(shape, dtype, torch.device("cpu"))
        b = zeroed_pool(shape, dtype, torch.device("cpu"))
        assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
        assert not a.any() and not b.any()
        a[1, 3].fill_(1.5)
        assert a.sum() == 1.5 * 16 * 2 * 8 and not b.any()


def test_pool_recycles_memory_without_leaking_old_values():
    """The point of zeros: a pool made where an earlier one (full of NaN) was freed reads zero."""
    shape = (2, 32, 16, 2, 8)
    for _ in range(3):
        old = zeroed_pool(shape, torch.float32, torch.device("cpu"))
        old.fill_(float("nan"))
        del old
        assert not zeroed_pool(shape, torch.float32, torch.device("cpu")).any()


def test_empty_pool():
    assert zeroed_pool((2, 0, 16, 2, 8), torch.float32, torch.device("cpu")).numel() == 0
