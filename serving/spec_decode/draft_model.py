"""The `draft_model` proposer (vLLM's method): a smaller trtforge engine, run in this process with
paged KV of its own, greedily decodes the drafts.

Keeping the draft in step. Per request the draft remembers the tokens its KV holds (a Sequence in
its own KVCacheManager: `num_computed_tokens` of them). After a proposal of k drafts it holds the
committed tokens C plus d_1..d_{k-1} (d_k was sampled, never fed). The target then commits C + the
accepted drafts + one token of its own, so at the next proposal:

    draft KV   [ C ............ | d_1 .. d_a | d_a+1 .. d_k-1 ]
    committed  [ C ............ | d_1 .. d_a | t ]               (a drafts accepted, t the target's)
               longest common prefix L ──────┘   rolled back: positions >= L are forgotten
                                                 (a block left holding none of them is freed)

then it feeds C'[L:] (one token after a rejection, two — d_k and t — after a full accept, the whole
prompt for a new request, in chunks of the draft's max_num_tokens) and decodes k - 1 more tokens
one by one. Every phase is one draft step for all the requests of the proposal (a packed batch
through the same prepare_inputs → executor path the engine uses), not a loop per request.

Greedy drafts are deterministic given the committed tokens, i.e. a point-mass proposal: the
verifier's rejection sampling (rejection.py: accept d with p(d), else draw from p without d) keeps
the target's distribution exactly, as for ngram, so no draft distribution is needed.

A request the draft cannot serve (its KV pool is full, the sequence outgrows the draft's
max_seq_len) gets no drafts and its draft state is dropped: speculation never fails a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from trtforge.config.fields import parse_bytes
from trtforge.config.speculative import SpeculativeConfig, unsupported
from trtforge.models.engine_dir import EngineConfig, read_engine_config
from trtforge.models.errors import EngineLoadError
from trtforge.models.kv_sizing import kv_num_blocks
from trtforge.serving.core.kv_cache_manager import KVCacheManager
from trtforge.serving.core.scheduler import ScheduledChunk, SchedulerOutput
from trtforge.serving.core.sequence import Sequence
from trtforge.serving.spec_decode.proposer import ProposalRequest
from trtforge.serving.worker.cpu_decode_plan import MAX_QUERY_LEN
from trtforge.serving.worker.executor import make_executor
from trtforge.serving.worker.model_inputs import prepare_inputs

_log = logging.getLogger(__name__)

VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
"""Tokenizer files that define the token ids (not tokenizer_config.json: a chat template or
model_max_length may differ between a draft and its target)."""


def check_draft(draft: EngineConfig, draft_dir: str, target: EngineConfig, device: str) -> None:
    """Refuse, naming both, a draft engine the target cannot take drafts from: another vocabulary
    (size or tokenizer files, compared by the sha256 each engine.json records), a backend or
    tensor-parallel mapping the in-process draft does not run, a device other than the CPU."""
    where = unsupported(draft.backend, draft.tp_size)
    if where is not None:
        raise ValueError(f"speculative draft_model {draft_dir!r} is {where}: the draft runs in the target's "
                         "process with the torch backend and tp_size 1; rebuild it with build-engine "
                         "--backend torch --tp-size 1")
    if torch.device(device).type != "cpu":
        raise ValueError(f"speculative draft_model runs on the CPU only (device={device!r}): run the engine "
                         "with --device cpu, or use method ngram")
    if draft.model.vocab_size != target.model.vocab_size:
        raise ValueError(f"speculative draft_model {draft_dir!r} has vocab_size={draft.model.vocab_size}, the "
                         f"target {target.model.vocab_size}: a draft must share the target's tokenizer and "
                         "vocabulary (build it from a checkpoint with the same tokenizer files)")
    ours = {n: target.files[n] for n in VOCABULARY_FILES if n in target.files}
    theirs = {n: draft.files[n] for n in VOCABULARY_FILES if n in draft.files}
    if ours != theirs:
        differ = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
        raise ValueError(f"speculative draft_model {draft_dir!r}: its tokenizer differs from the target's in "
                         f"{', '.join(differ)} (draft sha256 {_short(theirs, differ)}, target {_short(ours, differ)}): "
                         "a draft must share the target's tokenizer files")


def _short(files: dict[str, str], names: list[str]) -> str:
    return ", ".join(f"{n}={files[n][:12] if n in files else 'missing'}" for n in names)


@dataclass
class _Proposal:
    """One request's part of a proposal while it is computed."""

    seq: Sequence
    committed: int
    """len(prompt + outputs): the draft tokens start at this position."""
    k: int
    drafts: list[int]


class DraftModelProposer:
    """Greedy drafts of a smaller engine, its KV kept in step with each request's committed tokens."""

    def __init__(self, engine_dir: str | Path, target: EngineConfig, device: str = "cpu",
                 verify_checksums: bool = True):
        path = Path(engine_dir)
        if not (path / "engine.json").is_file():
            raise ValueError(f"speculative draft_model {str(engine_dir)!r} is not a trtforge engine directory "
                             f"(no {path / 'engine.json'}): build the draft with build-engine CHECKPOINT "
                             "--output DIR and pass that DIR as \"model\"")
        try:
            cfg = read_engine_config(path, verify_checksums=verify_checksums)
        except EngineLoadError as exc:
            raise EngineLoadError(f"speculative draft_model {str(engine_dir)!r}: {exc}") from None
        check_draft(cfg, str(engine_dir), target, device)
        self.engine_config = cfg
        self.block_size = cfg.block_size
        self.max_seq_len = cfg.max_seq_len
        self.max_num_tokens = int(cfg.build["max_num_tokens"])
        num_blocks = max(1, kv_num_blocks(cfg.model, cfg.dtype, cfg.block_size,
                                          parse_bytes(cfg.build["kv_cache_memory"]), cfg.kv_cache_dtype))
        self.executor = make_executor(str(path), cfg, num_blocks, device)
        # No prefix caching: a rollback cuts blocks that may have filled with drafts. Every block is
        # kept (sliding_window 0): a rollback never reaches back into a freed block.
        self.kv = KVCacheManager(num_blocks, cfg.block_size, enable_prefix_caching=False)
        self._seqs: dict[str, Sequence] = {}
        self._committed: dict[str, int] = {}  # request id -> its committed tokens at the last proposal

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: EngineConfig, device: str = "cpu",
                    verify_checksums: bool = True) -> DraftModelProposer:
        return cls(config.model, target, device, verify_checksums)

    @property
    def num_requests(self) -> int:
        """Requests whose tokens the draft's KV holds."""
        return len(self._seqs)

    # ---- the seam ---------------------------------------------------------------------------
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        work: dict[str, _Proposal] = {}
        for r in requests:
            p = self._catch_up_plan(r)
            if p is not None:
                work[r.request_id] = p
        if work:
            try:
                self._feed_committed(list(work.values()))
                self._decode(list(work.values()))
            except Exception:  # noqa: BLE001 - a failing draft costs its drafts, never a request
                _log.exception("draft_model: the draft step failed; no drafts this step for %s", list(work))
                for rid in work:
                    self.forget(rid)
                return [[] for _ in requests]
        return [work[r.request_id].drafts if r.request_id in work else [] for r in requests]

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._committed.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    # ---- keeping in step --------------------------------------------------------------------
    def _catch_up_plan(self, r: ProposalRequest) -> _Proposal | None:
        """Roll the request's draft KV back to its longest common prefix with the committed
        tokens, queue the missing ones and reserve blocks for them and the k - 1 fed drafts."""
        committed = r.token_ids
        n = len(committed)
        k = min(r.max_drafts, self.max_seq_len - n + 1)  # the last fed draft sits at n + k - 2
        if k < 1:
            self.forget(r.request_id)
            return None
        seq = self._seqs.get(r.request_id)
        if seq is None:
            seq = self._seqs[r.request_id] = Sequence(seq_id=r.request_id, prompt_token_ids=[], max_tokens=0)
        known = seq.prompt_token_ids  # == the tokens at positions [0, num_computed_tokens)
        keep = _common_prefix(known, committed, n - 1, self._committed.get(r.request_id, 0))  # last: always fed
        del known[keep:]
        seq.num_computed_tokens = keep
        self.kv.rollback(seq)
        known.extend(committed[keep:])
        self._committed[r.request_id] = n
        if not self.kv.allocate_for(seq, n - keep + k - 1):
            self.forget(r.request_id)  # the draft's pool is full: no drafts for it (this step)
            return None
        return _Proposal(seq, n, k, [])

    def _feed_committed(self, work: list[_Proposal]) -> None:
        """Compute the queued committed tokens of every request, in steps of at most the draft's
        max_num_tokens; the step that reaches a request's end gives its first draft."""
        while True:
            chunks, owners, budget = [], [], self.max_num_tokens
            for p in work:
                seq = p.seq
                left = len(seq.prompt_token_ids) - seq.num_computed_tokens
                if left == 0 or budget == 0:
                    continue
                n = min(left, budget)
                budget -= n
                chunks.append(self._chunk(seq, n, last=n == left))
                owners.append(p)
            if not chunks:
                return
            for p, chunk, token in zip(owners, chunks, self._step(chunks)):
                p.seq.num_computed_tokens += chunk.num_tokens
                if token is not None:
                    p.drafts.append(token)

    def _decode(self, work: list[_Proposal]) -> None:
        """Feed each request's latest draft and take the next, until each has its k."""
        while True:
            active = [p for p in work if len(p.drafts) < p.k]
            if not active:
                return
            for p in active:
                p.seq.prompt_token_ids.append(p.drafts[-1])
            chunks = [self._chunk(p.seq, 1, last=True) for p in active]
            for p, token in zip(active, self._step(chunks)):
                p.seq.num_computed_tokens += 1
                p.drafts.append(token)

    # ---- one draft step -----------------------------------------------------------------------
    def _chunk(self, seq: Sequence, n: int, last: bool) -> ScheduledChunk:
        """The next n uncomputed tokens of `seq`. A short last chunk asks for logits at every one
        of its tokens (as a verification does), which lets the CPU decode plan run it; only its
        last row is read."""
        start = seq.num_computed_tokens
        rows = n if last and n <= MAX_QUERY_LEN else 1
        return ScheduledChunk(seq_id=seq.seq_id, start=start, num_tokens=n, sample=last, is_decode=n == 1,
                              token_ids=seq.prompt_token_ids[start:start + n], block_table=seq.block_table,
                              num_draft_tokens=rows - 1 if last else 0)

    def _step(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        """Run one packed step; per chunk its greedy next token (None for a chunk that does not
        reach its sequence's end)."""
        sched = SchedulerOutput(chunks=chunks, num_batched_tokens=sum(c.num_tokens for c in chunks))
        inputs = prepare_inputs(sched, self.block_size, self.executor.device)
        logits = self.executor.execute(inputs)
        ends = torch.tensor(inputs.sample_num_rows).cumsum(0) - 1 if inputs.sample_num_rows else None
        tokens = iter(logits[ends.to(logits.device)].argmax(dim=-1).tolist() if ends is not None else [])
        return [next(tokens) if c.sample else None for c in chunks]


def _common_prefix(a: list[int], b: list[int], limit: int, hint: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`. `hint`: a length up to which
    they were equal last time (the committed tokens of the previous proposal): in the usual case
    one list comparison up to it (in C) and a few steps past it."""
    n = min(len(a), len(b), limit)
    lo = min(hint, n)
    if a[:lo] != b[:lo]:  # the history changed (not the engine's way; a reused id): search it
        hi, lo = lo - 1, 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo
