"""Zeroed KV pools that cost nothing until used.

Why zeros at all: a never-written slot must hold a finite value. The torch decode path batches
several sequences by gathering whole blocks and masking the positions past each sequence's length
(plugins/paged_attention/cpu.py `_decode_batch`): a masked score is -inf, its weight 0, but
0 × NaN is NaN, and SDPA adds the boolean mask as -inf (NaN + -inf is NaN). Whatever an
uninitialised allocation happened to hold (NaN bit patterns included) would leak into outputs.
Blocks that are reused hold an earlier sequence's finite K/V, so only the first use matters.

Why not `torch.zeros` on the CPU: it writes every byte up front — the default 2 GiB pool took
~3 s of page faults and memset at start-up on a 2-core machine, for blocks most runs never touch.
An anonymous `mmap` is zero by definition (the kernel maps a zero page on first touch), so the
pool is zero without anyone writing it, and only touched pages are ever allocated. On a GPU
`torch.zeros` is one memset at device bandwidth, so it stays.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on the CPU backed by anonymous memory that is faulted in lazily."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mmap object alive (frombuffer holds the buffer); unmapped when freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
