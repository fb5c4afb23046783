"""Fast paged attention in vectorised torch (the CPU engine's path; also correct on CUDA).

Algorithm, per call (one layer of one step):

0. A pure-decode float32 step with at most `cpu_native.MAX_CONTEXT_TOKENS` tokens of context goes
   to the C kernel instead (cpu_decode.c: KV write + attention in one call, its (sequence, KV
   head) pairs over the OpenMP threads; at batch 1 that replaces ~20 ATen ops per layer).
   0b. Any other float32 step (prompt chunks, mixed steps, speculative verification) goes there
   too, as one row per new token — its sequence's block table and position + 1 as its length
   (the kernel writes every row's K/V before any row attends) — with the same bound on the
   sequences' context tokens: 1.2-1.6x SDPA's speed on a 512-token prompt (6.3 vs 7.6-10.3 ms a
   layer, 2 threads, AMD EPYC), and bf16/fp16 keep SDPA.
   Everything below is the torch path for the rest.
1. Write the new k/v into the pool (one `index_copy_` per pool).
2. Decode tokens (sequences with exactly one new token) are done together in ONE fused SDPA
   call: their blocks are gathered with one `index_select` into a [B, Lpad, Hkv, D] batch
   (Lpad = longest context rounded up to whole blocks) and padding is masked out (one sequence:
   cut off instead; the mask of a step is built once and reused by every layer). GQA is handled
   by folding the G = Hq/Hkv query heads that share a kv head into SDPA's query-length axis
   (q [B, Hkv, G, D] against k [B, Hkv, Lpad, D]): no repeated KV is materialised, and SDPA
   measured 1.7x (fp32) to 7x (bf16) faster than with `enable_gqa=True` on single-token queries.
3. Every other sequence (a prompt or a prompt chunk) gets one SDPA call with `enable_gqa=True`
   (for long queries that measured faster than folding or repeating KV heads). A chunk with no
   cached context attends only to its own k/v, so those are used directly (no gather) with
   `is_causal=True`; a chunk after cached context gathers its blocks and uses an explicit
   offset-causal mask (`is_causal=True` would align the triangle to the top-left and hide
   cached positions from early tokens).

Gathered K/V land in reusable per-thread scratch buffers, not fresh tensors: a fresh multi-MB
allocation per call is served by mmap and paid for in page faults on first touch, which measured
~10x slower than the copy itself on a busy 2-core machine (12 ms vs 1.2 ms for 8 MiB).

int8 KV (`kv_scales` given): step 1 quantises (reference.write_kv), and every gather of step 2/3
gathers the int8 blocks and their scales and dequantises them into q's dtype
(`_gather_kv`); a chunk with no cached context also reads its k/v back from the pool, so every
path attends to the same quantised values the reference does.

Host-side work is a couple of `.tolist()` calls and per-sequence Python, never per token.
SDPA's CPU kernels accumulate in float32 for bf16/fp16 inputs.

Soft-capping (`softcap` > 0, Gemma 2): SDPA has no score hook, so every SDPA call above becomes
`_softcapped_attention` (the same gathers and masks; scores, tanh cap, softmax and P@V as explicit
float32 matmuls), and a pure-decode float32 step still goes to the C kernel, which caps its scores
itself.

Sliding window (`window` > 0; reference.py's rule, a token at p sees (p - window, p]): the decode
gather of step 2 starts at each sequence's first block inside its window (so blocks freed before it
are never read) and the mask also hides the positions before the window; a chunk of step 3 gathers
from its first token's first visible block and uses a banded causal mask (a chunk with no cached
context keeps `is_causal=True` while it is no longer than the window, where the band is the
triangle). The C kernel starts its walk at p - window + 1.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from trtforge.plugins.cpu import workspace
from trtforge.plugins.paged_attention import cpu_native
from trtforge.plugins.paged_attention.reference import write_kv

_workspace = threading.local()  # per thread: the kept decode mask (scratch buffers: plugins/cpu/workspace.py)


def _scratch(slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of numel elements (like's dtype/device), reused by later calls (plugins/cpu/workspace.py)."""
    return workspace.scratch(f"attention.{slot}", (numel,), like)


def clear_workspace() -> None:
    """Free this thread's scratch buffers and kept mask (they otherwise live as long as the thread)."""
    workspace.clear()
    _workspace.mask = None


def _gather_blocks(pool: torch.Tensor, tables: torch.Tensor, slot: int) -> torch.Tensor:
    """Blocks listed in tables [B, nb] of pool [num_blocks, bs, Hkv, D] -> [B, nb * bs, Hkv, D].

    The result is a view of scratch buffer `slot`: valid until the next gather into that slot.
    """
    num_seqs, num_blocks = tables.shape
    rows = pool.view(pool.shape[0], -1)  # [num_blocks, bs * Hkv * D]: one memcpy per block
    out = _scratch(slot, tables.numel() * rows.shape[1], pool).view(-1, rows.shape[1])
    torch.index_select(rows, 0, tables.reshape(-1), out=out)
    return out.view(num_seqs, num_blocks * pool.shape[1], *pool.shape[2:])


def _gather_kv(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, index: int, tables: torch.Tensor,
               like: torch.Tensor) -> torch.Tensor:
    """_gather_blocks of K (index 0) or V (1): int8 pools are dequantised (q * scale) into a
    scratch buffer of `like`'s dtype. [B, nb * bs, Hkv, D], valid until the next gather."""
    blocks = _gather_blocks(kv_cache[index], tables, index)
    if kv_scales is None:
        return blocks
    scales = _gather_blocks(kv_scales[index], tables, 2 + index)  # [B, nb * bs, Hkv]
    out = _scratch(4 + index, blocks.numel(), like)
    return torch.mul(blocks, scales.unsqueeze(-1), out=out.view(blocks.shape))


def _padding_mask(seq_lens: torch.Tensor, lens: list[int], padded_len: int, window: int = 0,
                  offsets: list[int] | None = None) -> torch.Tensor:
    """[B, 1, 1, padded_len] True where position < the sequence's length (window > 0: and
    position >= length - window; gathered position i is absolute position offsets[b] + i).

    Every layer of a step asks for the same mask, so the last one is kept per thread, keyed by
    the lengths' values (not the tensor's identity: callers may refill a tensor in place)."""
    key = (tuple(lens), padded_len, seq_lens.device, window, tuple(offsets or ()))
    memo = getattr(_workspace, "mask", None)
    if memo is not None and memo[0] == key and memo[1].is_inference() == torch.is_inference_mode_enabled():
        return memo[1]
    positions = torch.arange(padded_len, device=seq_lens.device)
    if window > 0:
        base = torch.tensor(offsets, device=seq_lens.device)[:, None] + positions[None, :]
        ends = torch.tensor(lens, device=seq_lens.device)[:, None]
        mask = ((base < ends) & (base >= ends - window))[:, None, None, :]
        _workspace.mask = (key, mask)
        return mask
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
    _workspace.mask = (key, mask)
    return mask


def _softcapped_attention(query, keys, values, scale: float, softcap: float, attn_mask=None,
                          is_causal: bool = False) -> torch.Tensor:
    """SDPA's contract ([B, H, n, D] queries against [B, Hkv, L, D], Hq a multiple of Hkv) with
    the scaled scores capped at ±softcap (softcap * tanh(s / softcap)) before the mask and the
    softmax, in float32. is_causal: SDPA's top-left aligned triangle."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale  # [B, Hq, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, length = scores.shape[-2:]
        attn_mask = torch.ones(n, length, dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(query.dtype)


def _attention(query, keys, values, scale: float, softcap: float, attn_mask=None, is_causal: bool = False,
               enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, or its soft-capped twin when softcap > 0."""
    if softcap:
        return _softcapped_attention(query, keys, values, scale, softcap, attn_mask, is_causal)
    if enable_gqa:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale)


def _window_tables(block_tables, lens: list[int], block_size: int, window: int):
    """Decode with a window: each sequence's table from its first block inside the window
    (position len - window). -> (tables [B, nb], the absolute position of each row's first gathered
    slot, nb)."""
    firsts = [max(0, n - window) // block_size for n in lens]
    num_blocks = max(-(-n // block_size) - f for n, f in zip(lens, firsts))
    device = block_tables.device
    index = (torch.tensor(firsts, device=device)[:, None] + torch.arange(num_blocks, device=device)[None, :])
    index = index.clamp_(max=block_tables.shape[1] - 1)  # past a sequence's end: masked padding
    return block_tables.gather(1, index.to(torch.int64)), [f * block_size for f in firsts], num_blocks


def _decode_batch(q, kv_cache, block_tables, seq_lens, scale: float, lens: list[int], kv_scales=None,
                  softcap: float = 0.0, window: int = 0):
    """One new token per sequence: q [B, Hq, D] -> [B, Hq, D], contexts padded to max(lens)
    (window > 0: to the longest windowed span, gathered from each sequence's first block in it)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_len = max(lens)
    offsets = None
    if window > 0 and max_len > window:
        tables, offsets, num_blocks = _window_tables(block_tables, lens, block_size, window)
    else:
        window = 0  # no sequence is longer than the window: the whole context is visible
        num_blocks = -(-max_len // block_size)
        tables = block_tables[:, :num_blocks]  # int32 or int64: index_select takes both
    keys = _gather_kv(kv_cache, kv_scales, 0, tables, q).transpose(1, 2)    # [B, Hkv, Lpad, D]
    values = _gather_kv(kv_cache, kv_scales, 1, tables, q).transpose(1, 2)  # [B, Hkv, Lpad, D]
    query = q.view(num_seqs, num_kv_heads, group, head_dim)          # [B, Hkv, G, D]
    if num_seqs == 1:
        # One sequence: cut the padding off instead of masking it (SDPA is ~30 % faster unmasked).
        lo = 0 if offsets is None else max(0, max_len - window) - offsets[0]
        hi = max_len if offsets is None else max_len - offsets[0]
        out = _attention(query, keys[:, :, lo:hi], values[:, :, lo:hi], scale, softcap)
    else:
        mask = _padding_mask(seq_lens, lens, num_blocks * block_size, window, offsets)
        out = _attention(query, keys, values, scale, softcap, attn_mask=mask)
    return out.reshape(num_seqs, num_heads, head_dim)


def _band(positions: torch.Tensor, context: torch.Tensor, window: int) -> torch.Tensor:
    """[n, L] True where context position c is visible from query position p: c <= p, and
    (window > 0) c > p - window."""
    visible = context[None, :] <= positions[:, None]
    if window > 0:
        visible &= context[None, :] > positions[:, None] - window
    return visible


def _prefill_one(q, k, v, kv_cache, block_table, cached: int, scale: float, kv_scales=None,
                 softcap: float = 0.0, window: int = 0):
    """One sequence's chunk of n new tokens after `cached` context: q [n, Hq, D] -> [n, Hq, D]
    (window > 0: each token sees only its last `window` positions)."""
    num_new = q.shape[0]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    device = q.device
    if cached == 0 and kv_scales is None and k.dtype == kv_cache.dtype:
        # The whole context is this chunk: attend to k/v as given, no gather from the pool.
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if window <= 0 or num_new <= window:  # the band is the whole causal triangle
            out = _attention(query, keys, values, scale, softcap, is_causal=True, enable_gqa=True)
        else:
            positions = torch.arange(num_new, device=device)
            out = _attention(query, keys, values, scale, softcap, attn_mask=_band(positions, positions, window),
                             enable_gqa=True)
    else:
        seq_len, block_size = cached + num_new, kv_cache.shape[2]
        # The first block any new token sees (window: the first token's cached - window + 1).
        first = (max(0, cached - window + 1) if window > 0 else 0) // block_size
        table = block_table[first: -(-seq_len // block_size)][None]
        start, length = first * block_size, seq_len - first * block_size
        keys = _gather_kv(kv_cache, kv_scales, 0, table, q)[:, :length].transpose(1, 2)  # [1, Hkv, L, D]
        values = _gather_kv(kv_cache, kv_scales, 1, table, q)[:, :length].transpose(1, 2)
        # Token j (absolute position cached + j) sees positions 0..cached + j (window: the last `window`).
        visible = _band(cached + torch.arange(num_new, device=device),
                        torch.arange(start, seq_len, device=device), window)  # [n, L]
        out = _attention(query, keys, values, scale, softcap, attn_mask=visible, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def paged_attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                    scale: float, kv_scales: torch.Tensor | None = None, softcap: float = 0.0,
                    window: int = 0) -> torch.Tensor:
    """Write k/v into kv_cache, then causal paged attention; see the op contract in op.py. -> [T, Hq, D].
    kv_scales: the scales of an int8 kv_cache (None: kv_cache is in q's dtype).
    softcap: > 0 caps the scaled scores (reference.paged_attention); 0: none.
    window: > 0 the sliding window (reference.paged_attention); 0: full causal attention."""
    if kv_scales is None and kv_cache.dtype != q.dtype:
        raise ValueError(f"the torch attention path needs kv_cache in q's dtype; got kv_cache "
                         f"{kv_cache.dtype} and q {q.dtype}: build the KV pool in the model dtype")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    new_counts = [starts[s + 1] - starts[s] for s in range(num_seqs)]
    decodes = [s for s in range(num_seqs) if new_counts[s] == 1]
    pure_decode = 0 < len(decodes) == num_seqs == q.shape[0]
    if pure_decode and cpu_native.applies(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, lens,
                                          kv_scales):
        return cpu_native.decode(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale, kv_scales,
                                 softcap, window)
    if not pure_decode and q.dtype is torch.float32 and q.is_cpu and q.shape[0] > 0:  # step 0b: one row a token
        counts = torch.tensor(new_counts, device=q.device)
        token_lens = torch.tensor([n + 1 + i for s in range(num_seqs) for n in [lens[s] - new_counts[s]]
                                   for i in range(new_counts[s])], dtype=torch.int32, device=q.device)
        if token_lens.shape[0] == q.shape[0]:  # query_start_loc covers every token
            tables = block_tables.repeat_interleave(counts, dim=0)
            if cpu_native.applies(q, k, v, kv_cache, slot_mapping, tables, token_lens, lens, kv_scales):
                return cpu_native.decode(q, k, v, kv_cache, slot_mapping, tables, token_lens, scale, kv_scales,
                                         softcap, window)
    write_kv(kv_cache, k, v, slot_mapping, kv_scales)
    if pure_decode:
        # The common case: tokens are already in sequence order.
        return _decode_batch(q, kv_cache, block_tables, seq_lens, scale, lens, kv_scales, softcap, window)
    out = q.new_empty(q.shape)
    if decodes:
        index = torch.tensor(decodes, device=q.device)
        tokens = torch.tensor([starts[s] for s in decodes], device=q.device)
        result = _decode_batch(q.index_select(0, tokens), kv_cache,
                               block_tables.index_select(0, index),
                               seq_lens.index_select(0, index), scale, [lens[s] for s in decodes], kv_scales,
                               softcap, window)
        out.index_copy_(0, tokens, result)
    for s in range(num_seqs):
        if new_counts[s] < 2:
            continue
        a, b = starts[s], starts[s + 1]
        out[a:b] = _prefill_one(q[a:b], k[a:b], v[a:b], kv_cache, block_tables[s],
                                lens[s] - new_counts[s], scale, kv_scales, softcap, window)
    return out
