"""SchedulerOutput (ids, counts, token ids, block tables) → the tensors one iteration needs.

The only place where the scheduler's plain data becomes tensors; it reads the chunks' own copies,
never a Sequence, so it could run in another process than the scheduler. Chunks are packed back to back
(decodes first, then prefill chunks — the scheduler's order); a chunk whose last token reaches
the end of its sequence contributes one row of logits — a verification chunk (speculative
decoding: its last token + k drafts) one row per token, k + 1 rows, in order. A prefill chunk of a
request asking for prompt logprobs (`prompt_positions`) also contributes the rows of its prompt
positions still to score, after every sampling row (serving/prompt_logprobs.py).

Sliding window: a table's leading entries may be FREED_BLOCK (-1), blocks released because they fell
out of every layer's window (serving/core/kv_cache_manager.py). No attention implementation reads
them (each starts at its window), but the tensor gets block 0 there, as in the padding, so that no
consumer — a kernel, the CPU decode plan, a tensor-parallel message's bounds check, a CUDA graph's
static table — ever holds a negative block id. A new token never lands in a freed block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.core.kv_cache_manager import FREED_BLOCK
from trtforge.serving.core.scheduler import SchedulerOutput
from trtforge.serving.core.sequence import SeqId


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    """int64 [T] packed new tokens."""
    positions: torch.Tensor
    """int64 [T] absolute positions."""
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """int64 [S']: index in the packed batch of the last token of each chunk that samples."""
    sample_seq_ids: list[SeqId]
    """seq_id of each sampling chunk, in order (its rows follow one another)."""
    sample_num_rows: list[int] = field(default_factory=list)
    """Logits rows of each sampling chunk (1, or 1 + its drafts); [] means one each."""
    prompt_rows: list[tuple[SeqId, int, int]] = field(default_factory=list)
    """Prompt logprobs: (seq_id, first position, number of rows) of each chunk's prompt-position
    rows, which follow all the sampling rows in `logits_indices`, in this order."""

    @property
    def num_sample_rows(self) -> int:
        """Logits rows the sampler reads: the leading ones (the prompt-logprob rows follow)."""
        return int(self.logits_indices.shape[0]) - sum(n for _, _, n in self.prompt_rows)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device | str = "cpu",
                   prompt_positions: dict[SeqId, tuple[int, int]] | None = None) -> ModelInputs:
    """`prompt_positions`: {seq_id: (first, end)} of the requests asking for prompt logprobs, the
    positions [first, end) whose logits rows are still needed; a prefill chunk of theirs adds the
    rows of its positions in that range."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    logits_indices: list[int] = []
    sample_ids: list[SeqId] = []
    sample_rows: list[int] = []
    tables = []
    extra: list[int] = []
    prompt_rows: list[tuple[SeqId, int, int]] = []
    for chunk in out.chunks:
        start, n, table = chunk.start, chunk.num_tokens, chunk.block_table
        end = start + n
        ids.extend(chunk.token_ids)
        if table[start // block_size] == FREED_BLOCK:
            raise RuntimeError(f"sequence {chunk.seq_id}: its chunk at position {start} would write into a block "
                               "freed out of the sliding window (a scheduler bug)")
        for p in range(start, end):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        tables.append([0 if b == FREED_BLOCK else b for b in table] if table[0] == FREED_BLOCK else table)
        wanted = prompt_positions.get(chunk.seq_id) if prompt_positions and not chunk.is_decode else None
        if wanted is not None:
            lo, hi = max(start, wanted[0]), min(end, wanted[1])
            if lo < hi:
                base = starts[-1] - n - start  # packed index of position 0 of this chunk's sequence
                extra.extend(range(base + lo, base + hi))
                prompt_rows.append((chunk.seq_id, lo, hi - lo))
        if chunk.sample:
            rows = 1 + chunk.num_draft_tokens
            logits_indices.extend(range(starts[-1] - rows, starts[-1]))
            sample_ids.append(chunk.seq_id)
            sample_rows.append(rows)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    i32, i64 = torch.int32, torch.int64
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=i64, device=device),
        block_tables=torch.tensor(padded, dtype=i32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=i32, device=device),
        query_start_loc=torch.tensor(starts, dtype=i32, device=device),
        max_query_len=max(c.num_tokens for c in out.chunks),
        max_seq_len=max(seq_lens),
    )
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=i64, device=device),
        positions=torch.tensor(positions, dtype=i64, device=device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices + extra, dtype=i64, device=device),
        sample_seq_ids=sample_ids,
        sample_num_rows=sample_rows,
        prompt_rows=prompt_rows,
    )
