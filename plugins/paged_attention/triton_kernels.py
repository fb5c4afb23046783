"""OpenAI-Triton kernels for the paged-KV attention op (contract: op.py).

Three kernels, launched by `paged_attention_triton` (the op's CUDA implementation):

1. `_write_kv_kernel` stores the new tokens' k/v at their flat slots (vLLM's
   `reshape_and_cache`). Attention then reads every position, new ones included, from the pool.
2. `_attention_kernel`, ONE launch for a mixed batch (prompts, prompt chunks after cached
   context, decode tokens). A program owns (a block of BLOCK_Q new tokens of one sequence,
   one KV head [, one KV split]). The G = Hq/Hkv query heads that share that KV head are folded
   into the tile's M dimension, so each K/V tile is loaded once for all of them:

       tile row m  ->  token  q_block*BLOCK_Q + m // G,  query head  kv_head*G + m % G

       pool kv_cache[2, num_blocks, block_size, Hkv, D]   (index 0 = K, 1 = V; NHD per block)
       KV tile (TILE_N positions of the sequence):
         pos        = tile*TILE_N + n
         block id   = block_tables[seq, pos // block_size]     <- read per tile, any block size
         address    = kv_cache[kv, block id, pos % block_size, kv_head, :]

   Scores use the online softmax (running max m, running sum l, unnormalised acc) in fp32, in the
   log2 domain (exp2 with scale*log2(e) folded into the scores). New token j of a sequence with
   `ctx = seq_len - q_len` cached positions sits at absolute position ctx + j and sees positions
   0..ctx + j (causal mask with the cached-context offset); with WINDOW > 0 (sliding window) only
   (ctx + j - WINDOW, ctx + j], and the tile loop starts at the tile of the block's first token's
   first visible position (earlier blocks are never read: they may be freed).
3. Split-KV (flash-decoding): with NUM_SPLITS > 1 the tiles of each sequence are partitioned,
   every split writes its partial (m, l, acc) to fp32 scratch, and `_combine_splits_kernel`
   merges them:  out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i,  M = max_i m_i.
   It keeps the GPU busy when a decode batch has few (sequence, KV head) pairs but long contexts.

The grid's first axis counts query blocks without a device->host sync: sequence s owns blocks
[qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1) (at least ceil(q_len / BLOCK_Q) of them),
so T // BLOCK_Q + S programs always suffice; surplus programs exit at once, and each program
finds its sequence by a binary search over query_start_loc.

On a machine without CUDA the kernels run on CPU tensors in Triton's interpreter (slow, for
tests); `TRITON_INTERPRET` is read when `@triton.jit` decorates, hence the env var set below.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # after the TRITON_INTERPRET default above
import triton.language as tl

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


# Only `@builtin` language functions in the kernels, not the `@jit` helpers of
# triton.language.standard (tl.zeros, tl.sum, tl.max, tl.cdiv): those are made compiled-or-
# interpreted once, when `triton` is first imported, and torch._dynamo imports it early; under
# the CPU interpreter they can then be compiled functions that cannot run. Reductions use
# tl.reduce with the standard combine functions, which the interpreter recognises by identity
# and runs as numpy reductions (a combine function of our own would run element by element).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


_SUM = getattr(tl.standard, "_sum_combine", _add)
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """Program (token t, KV head h): copy k[t, h], v[t, h] to the pool at slot_mapping[t]."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token with nothing to cache (vLLM's rule)
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
               + h * stride_c_head + d)
        t64 = t.to(tl.int64)
        key = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=d_ok)
        val = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=d_ok)
        tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=d_ok)
        tl.store(dst + stride_c_kv, val.to(cache_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block q_block: last s with qsl[s] // BLOCK_Q + s <= q_block."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attention_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                      out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                      scale_log2, num_seqs, window,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                      TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      DOT_FP32: tl.constexpr):
    """Program (query block, KV head, KV split): causal attention of BLOCK_Q tokens x GROUP heads."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q < q_len:
        ctx_len = tl.load(seq_lens_ptr + seq) - q_len

        m = tl.arange(0, BLOCK_M)
        tok = local_block * BLOCK_Q + m // GROUP          # index among the sequence's new tokens
        head = kv_head * GROUP + m % GROUP                # query head of tile row m
        row_ok = (m // GROUP < BLOCK_Q) & (tok < q_len)   # BLOCK_M may exceed BLOCK_Q * GROUP
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        rows = (q_start + tok).to(tl.int64)               # packed-batch row of each tile row
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # [BLOCK_M, HEAD_DIM_P]
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = ctx_len + tok                             # absolute position of each row's token

        # The block's last token bounds the causal range; splits share its tiles evenly.
        kv_end = ctx_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
        num_tiles = (kv_end + TILE_N - 1) // TILE_N
        # Sliding window: the block's first token (position ctx + local_block * BLOCK_Q) sees from
        # kv_start on; nothing before it is loaded.
        kv_start = tl.maximum(ctx_len + local_block * BLOCK_Q - window + 1, 0) if window > 0 else 0
        first_tile = kv_start // TILE_N
        tiles_per_split = (num_tiles - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM_P], 0.0, tl.float32)
        n = tl.arange(0, TILE_N)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for tile in range(tile_lo, tile_hi):
            pos = tile * TILE_N + n
            pos_ok = (pos < kv_end) & (pos >= kv_start)
            blk = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            kv_off = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
            k = tl.load(cache_ptr + kv_off[None, :] + d[:, None],
                        mask=pos_ok[None, :] & d_ok[:, None], other=0.0)      # [HEAD_DIM_P, TILE_N]
            v = tl.load(cache_ptr + stride_c_kv + kv_off[:, None] + d[None, :],
                        mask=pos_ok[:, None] & d_ok[None, :], other=0.0)      # [TILE_N, HEAD_DIM_P]
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2     # [BLOCK_M, TILE_N]
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            # A row with nothing visible yet keeps m = -inf; subtract 0 there to avoid inf - inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # Scratch layout [T, Hq, NUM_SPLITS] (+ [HEAD_DIM_P] for acc), contiguous.
            part = (rows * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + d[None, :], acc,
                     mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_P: tl.constexpr):
    """Program (token t, query head h): merge the NUM_SPLITS partial softmaxes of (t, h)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    part = (t * tl.num_programs(1) + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + part)
    lsum = tl.load(part_l_ptr + part)
    m_max = tl.reduce(m, 0, _MAX)
    weight = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for empty splits
    denom = tl.reduce(weight * lsum, 0, _SUM)
    d = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + d[None, :])  # [NUM_SPLITS, D_P]
    out = tl.reduce(acc * weight[:, None], 0, _SUM) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    """Raise a ValueError naming the offending value when the inputs break the op contract (op.py)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D] with Hkv, D = "
                         f"{tuple(k.shape[1:])} from k; got {tuple(kv_cache.shape)}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} does not match k {tuple(k.shape)}: need the same T "
                         "and D, and Hq a multiple of Hkv")
    if q.dtype != kv_cache.dtype or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
        raise ValueError(f"q, k, v and kv_cache must share one dtype (the engine's); got q "
                         f"{q.dtype}, k {k.dtype}, v {v.dtype}, kv_cache {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (it is indexed by flat slot); allocate it "
                         "with torch.empty/zeros, not as a view")
    tensors = dict(q=q, k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping,
                   block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all inputs must be on one device; got {devices}")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"need query_start_loc [S+1] and block_tables [S, *] for seq_lens [S]; "
                         f"got {tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}, "
                         f"{tuple(seq_lens.shape)}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """q/k/v are often column slices of a fused QKV projection: rows may be strided, D may not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping.

    A negative slot skips its token (padding). In place; casts to the pool's dtype.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim))


def _interpreting() -> bool:
    """Triton's CPU interpreter multiplies bf16 tiles as raw integers (triton 3.9), so dots
    there run on fp32 copies; compiled GPU kernels keep bf16 tensor-core dots."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(q: torch.Tensor, num_programs: int, max_seq_len: int, tile_n: int) -> int:
    """Splits that bring the launch to ~4 programs per SM, with >= 4 KV tiles per split.

    On CPU (interpreter) splitting only costs time, so the default there is 1.
    """
    if q.device.type != "cuda":
        return 1
    wanted = triton.cdiv(4 * _num_sms(q.device.index or 0), max(num_programs, 1))
    by_length = triton.cdiv(max_seq_len, 4 * tile_n)
    return _pow2_floor(max(1, min(wanted, by_length, _MAX_SPLITS)))


def _pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def _tile_shape(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N): 16-row tiles for decode, 64-row tiles for prompts."""
    block_m = 16 if max_query_len * group <= 16 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group, 32 if block_m == 16 else 64


def paged_attention_triton(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
                           query_start_loc, scale: float, max_query_len: int, max_seq_len: int,
                           *, num_kv_splits: int | None = None, tile_n: int | None = None,
                           num_warps: int = 4, window: int = 0) -> torch.Tensor:
    """The paged-attention op (contract: op.py) on Triton kernels: write k/v, then attend.

    q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D] (updated in
    place), slot_mapping int64 [T], block_tables int32 [S, W], seq_lens int32 [S],
    query_start_loc int32 [S+1]. max_query_len / max_seq_len: host copies of the maxima (they
    size the grid without a device sync). num_kv_splits: KV partitions per sequence (rounded
    down to a power of two, at most 64); None picks one from the device's SM count.
    tile_n (KV positions per tile, a power of two >= 16) and num_warps override the tuned
    defaults; benchmarks sweep them. window: > 0 sliding window (op.py), 0 full causal attention.
    Returns [T, Hq, D] in q's dtype. Rows of tokens outside query_start_loc[S] are undefined.
    """
    _check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
        raise ValueError(f"tile_n must be a power of two >= 16 (tl.dot's minimum), got {tile_n}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (or None for automatic), got {num_kv_splits}")
    # 1-D metadata and table rows are indexed with unit stride in the kernels.
    slot_mapping, block_tables = slot_mapping.contiguous(), block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    write_kv_cache(k, v, kv_cache, slot_mapping)
    q = _last_dim_contiguous(q)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_seqs = k.shape[1], seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, default_tile_n = _tile_shape(group, max_query_len)
    tile_n = tile_n or default_tile_n
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_kv_splits is None:
        # Only min(num_q_blocks, T) query blocks can hold tokens; the others exit at once.
        busy = min(num_q_blocks, num_tokens) * num_kv_heads
        num_kv_splits = _default_num_splits(q, busy, max_seq_len, tile_n)
    splits = _pow2_floor(min(num_kv_splits, _MAX_SPLITS))
    head_dim_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K, N >= 16
    scratch_shape = (num_tokens, num_heads, splits) if splits > 1 else (1,)
    part_m = torch.empty(scratch_shape, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((*scratch_shape, head_dim_p) if splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    _attention_kernel[(num_q_blocks, num_kv_heads, splits)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_m, part_l,
        float(scale) * _LOG2E, num_seqs, int(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        NUM_SPLITS=splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DOT_FP32=_interpreting() and q.dtype == torch.bfloat16, num_warps=num_warps)
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p)
    return out
