"""The message rank 0 broadcasts to the other tensor-parallel ranks, and the bounds they hold it to.

    header  int64 [8]: kind, body length, then the kind's fields (zeros after them)
    body    int64 [body length], STEP only:
            input_ids[T] positions[T] slot_mapping[T] block_tables[S·W] seq_lens[S]
            query_start_loc[S+1] logits_indices[S']

    kind   fields                                   body
    STEP   T, S, W, S', max_query_len, max_seq_len  3T + S·W + 2S + 1 + S' values
    INIT   KV blocks, the engine's identity          none
    PING   -                                         none (followed by a one-value all-reduce)
    STOP   -                                         none

A rank checks every header against its own engine's limits (`MessageLimits`: max_num_tokens,
max_batch_size, max_seq_len, the KV pool) before it allocates the body, and every body's values
(token ids in the vocabulary, slots and block ids in the pool, offsets consistent) before its
network reads them: a message that does not fit is a MessageError saying what it claimed and
what the limit is, never an allocation of whatever size a header names, or an index past the
end of the KV pool in a C kernel. Rank 0 holds its own steps to the same limits before sending.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trtforge.models.engine_dir import EngineConfig
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.worker.model_inputs import ModelInputs

STEP, PING, STOP, INIT = 1, 2, 3, 4
KINDS = {STEP: "STEP", PING: "PING", STOP: "STOP", INIT: "INIT"}
HEADER = 8
_STEP_FIELDS = 6


class MessageError(ValueError):
    """A message from rank 0 that does not fit this rank's engine (nothing was allocated for it)."""


@dataclass(frozen=True)
class MessageLimits:
    """What a message may claim on a rank, from its own engine.json and KV pool."""

    max_tokens: int
    """Tokens of one step: the engine's max_num_tokens (its build limit)."""
    max_seqs: int
    """Sequences of one step: the engine's max_batch_size."""
    max_seq_len: int
    block_size: int
    vocab_size: int
    max_blocks: int
    """KV blocks: before INIT, the most this rank's memory can hold; after it, the pool's."""

    @classmethod
    def for_engine(cls, cfg: EngineConfig, max_blocks: int) -> MessageLimits:
        return cls(max_tokens=int(cfg.build["max_num_tokens"]), max_seqs=int(cfg.build["max_batch_size"]),
                   max_seq_len=cfg.max_seq_len, block_size=cfg.block_size, vocab_size=cfg.model.vocab_size,
                   max_blocks=max_blocks)

    def with_blocks(self, num_blocks: int) -> MessageLimits:
        return replace(self, max_blocks=num_blocks)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def step_size_problem(self, t: int, s: int, width: int, rows: int) -> str | None:
        """What is wrong with a step of `t` tokens, `s` sequences, block tables `width` wide and
        `rows` logits rows (None: it fits)."""
        for name, value, lo, hi, limit in (
                ("tokens", t, 1, self.max_tokens, "the engine's max_num_tokens"),
                ("sequences", s, 1, min(t, self.max_seqs), "the engine's max_batch_size and the step's tokens"),
                ("blocks per sequence", width, 1, self.max_blocks_per_seq, "max_seq_len / kv_block_size"),
                ("logits rows", rows, 0, t, "the step's tokens")):
            if not lo <= value <= hi:
                return f"a step of {value} {name}, outside {lo}..{hi} ({limit})"
        return None

    def check_header(self, kind: int, n: int, fields: list[int]) -> None:
        """MessageError unless the header is one this rank can take; before anything is allocated."""
        name = KINDS.get(kind)
        if name is None:
            raise MessageError(f"a message of unknown kind {kind} (known: {sorted(KINDS)})")
        used = {STEP: _STEP_FIELDS, INIT: 2}.get(kind, 0)
        if any(fields[used:]):
            raise MessageError(f"a {name} header with {fields[used:]} after its {used} fields (must be zeros)")
        if kind != STEP:
            if n:
                raise MessageError(f"a {name} message claiming a body of {n} values (it has none)")
            if kind == INIT and not 1 <= fields[0] <= self.max_blocks:
                raise MessageError(f"INIT asks for {fields[0]} KV blocks; this rank's memory holds at most "
                                   f"{self.max_blocks} of this engine's blocks")
            return
        t, s, width, rows, max_q, max_s = fields[:_STEP_FIELDS]
        problem = self.step_size_problem(t, s, width, rows)
        if problem is None and not (1 <= max_q <= t and 1 <= max_s <= self.max_seq_len):
            problem = f"max_query_len {max_q} / max_seq_len {max_s} outside 1..{t} / 1..{self.max_seq_len}"
        want = body_len(t, s, width, rows)
        if problem is None and n != want:
            problem = f"a body of {n} values where T={t}, S={s}, W={width}, S'={rows} make {want}"
        if problem:
            raise MessageError(f"a STEP header claiming {problem}")


def body_len(t: int, s: int, width: int, rows: int) -> int:
    return 3 * t + s * width + 2 * s + 1 + rows


def encode_step(inputs: ModelInputs, limits: MessageLimits) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A step's ModelInputs as (body, header fields); ValueError for a step larger than the limits
    every rank holds it to (the group stays usable: only this step's requests fail)."""
    m = inputs.meta
    s, width = m.block_tables.shape
    rows = int(inputs.logits_indices.numel())
    problem = limits.step_size_problem(inputs.num_tokens, s, width, rows)
    if problem:
        raise ValueError(f"tensor parallelism: {problem}; lower the scheduler's budget to the engine's "
                         f"build limits or rebuild the engine")
    parts = [inputs.input_ids, inputs.positions, m.slot_mapping, m.block_tables.reshape(-1), m.seq_lens,
             m.query_start_loc, inputs.logits_indices]
    body = torch.cat([p.to(torch.int64) for p in parts])
    return body, (inputs.num_tokens, s, width, rows, int(m.max_query_len), int(m.max_seq_len))


def decode_step(body: torch.Tensor, fields: list[int], limits: MessageLimits) -> ModelInputs:
    """The ModelInputs rank 0 encoded (no seq ids: ranks > 0 do not sample), its values checked
    (MessageError) against `limits` (after INIT: this rank's pool)."""
    t, s, width, rows, max_q, max_s = fields[:_STEP_FIELDS]
    ids, pos, slots, tables, seq_lens, starts, logits_indices = body.split([t, t, t, s * width, s, s + 1, rows])
    q_lens = starts[1:] - starts[:-1]
    top_len = min(limits.max_seq_len, width * limits.block_size)
    checks = (("input_ids", ids, 0, limits.vocab_size - 1), ("positions", pos, 0, limits.max_seq_len - 1),
              ("slot_mapping", slots, 0, limits.max_blocks * limits.block_size - 1),
              ("block_tables", tables, 0, limits.max_blocks - 1), ("seq_lens", seq_lens, 1, top_len),
              ("query lengths", q_lens, 1, t), ("logits_indices", logits_indices, 0, t - 1))
    ok = torch.stack([((v >= lo) & (v <= hi)).all() for _, v, lo, hi in checks]
                     + [starts[0] == 0, starts[-1] == t, q_lens.max() == max_q, seq_lens.max() == max_s,
                        (q_lens <= seq_lens).all()])
    if not bool(ok.all()):  # one sync on the good path; the message names the first bad part
        bad = [f"{name} outside {lo}..{hi}" for name, v, lo, hi in checks if not ((v >= lo) & (v <= hi)).all()]
        raise MessageError("a STEP body with " + (", ".join(bad) or "query_start_loc, max_query_len or "
                                                  "max_seq_len inconsistent with its lengths"))
    i32 = torch.int32
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(s, width).to(i32),
                             seq_lens=seq_lens.to(i32), query_start_loc=starts.to(i32),
                             max_query_len=max_q, max_seq_len=max_s)
    return ModelInputs(input_ids=ids, positions=pos, meta=meta, logits_indices=logits_indices, sample_seq_ids=[])
