"""In-flight batching scheduler: one call to `schedule()` = the batch of one iteration.

The scheduler knows ids, counts and block tables, never tensors. Each iteration:

1. Running sequences, oldest first (add() order): a decode gets 1 token (its last sampled token,
   whose K/V is not cached yet); a sequence still being prefilled — a chunked prompt, or the
   recompute of a preempted one — gets its next chunk, leaving enough budget for the decodes behind
   it. When a block is needed and none is free (max_utilization), the newest running sequence is
   preempted: its blocks are freed and it goes back to the front of the waiting queue, to recompute
   prompt + outputs later (chunked like a prompt; the chunk that reaches the end samples).
2. Waiting sequences — preempted ones first, then new ones in `prefill_order` — are admitted while
   the token budget, prefill budget, prefill_max_seqs, max_batch_size and KV blocks allow. Under
   fcfs a request that does not fit stops admission (no overtaking: a long prompt is never starved
   by short ones arriving behind it). Nothing is admitted in an iteration that had to preempt.

Speculative decoding: `schedule(drafts)` gives a decode with drafts one chunk of 1 + k tokens (its
last token, then the drafts), taken from the same token budget, after the plain decode token of
every running decode is reserved; k is capped so that accepting all of them stays within
max_tokens, and the drafts are dropped rather than preempting anyone for their KV. `update` then
commits the accepted drafts plus one token and rolls the table back to the computed tokens: the
rejected drafts' slots are forgotten and a block holding only them is freed. Only computed
(committed) tokens ever reach the prefix cache.

Under guaranteed_no_evict a request is admitted only when its whole KV need (prompt + max_tokens)
fits in the free blocks not already promised to running sequences, so a running sequence always
finds its next block and nothing is ever preempted.

Sliding window (`sliding_window` > 0, every layer windowed): after each step a sequence's blocks
before its window are freed (KVCacheManager.free_out_of_window), so its KV need is what it holds at
once, `kv_need_blocks` — about ceil(W / block_size) + 1 blocks in decode, a little more while a
prefill chunk is computed — not its whole length: that is what admission and the pool check count.
A verification chunk is kept within the prefill chunk cap so that bound holds for drafts too.

A SchedulerOutput is plain data — ids, counts, and copies of the chunk's tokens and block table —
never a live Sequence: whoever executes the batch (this process, another tensor-parallel rank, the
other phase of disaggregated serving) can neither see nor change the scheduler's state.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.core.kv_cache_manager import KVCacheManager, PrefixHit
from trtforge.serving.core.sequence import SeqId, Sequence, SequenceStatus


class EngineOverloaded(RuntimeError):
    """A request refused because the waiting queue is full (max_queue_size / max_queued_tokens).

    Not a ValueError: the request is fine and may be retried later, so callers answer it apart
    from bad requests (Triton: UNAVAILABLE, not "bad request"; OpenAI: 503, not 400)."""


@dataclass
class ScheduledChunk:
    """Tokens of one sequence to compute in this iteration (copies: no scheduler state)."""

    seq_id: SeqId
    """The sequence's id (the engine's request id)."""
    start: int
    """seq.num_computed_tokens before this step: absolute position of the first new token."""
    num_tokens: int
    """Tokens to compute now: positions [start, start + num_tokens)."""
    sample: bool
    """start + num_tokens == seq.num_tokens: the engine samples the next token from the last one."""
    is_decode: bool
    """A decode step (one token of a sequence that has outputs), as opposed to a prefill chunk."""
    token_ids: list[int]
    """The tokens to compute, seq.all_token_ids[start:start + num_tokens] (a new list)."""
    block_table: list[int]
    """A copy of the sequence's block table, covering at least start + num_tokens positions: where
    the new K/V go (slot mapping) and where attention reads the earlier ones."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last num_draft_tokens of token_ids are proposed drafts to verify
    (a decode of 1 + num_draft_tokens tokens; the executor returns logits at every one of them)."""


@dataclass
class KVImport:
    """KV that arrives from outside (a handoff): fill these blocks before the step runs."""

    seq_id: SeqId
    num_tokens: int
    """Positions [0, num_tokens) of the sequence."""
    block_table: list[int]
    """The blocks that hold them from block first_block on, in order (a copy)."""
    first_block: int = 0
    """The handoff's first block (sliding window: the ones before it were not handed over)."""


@dataclass
class SchedulerOutput:
    """The batch of one iteration."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Decodes first, then prefill chunks."""
    preempted: list[SeqId] = field(default_factory=list)
    """Ids of the sequences preempted in this step (their KV is gone; they wait to be recomputed)."""
    num_batched_tokens: int = 0
    """Sum of the chunks' num_tokens."""
    kv_imports: list[KVImport] = field(default_factory=list)
    """Sequences admitted with external KV (num_external_tokens): the engine copies it in first."""

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class _Budget:
    tokens: int
    prefill_tokens: int
    prefill_seqs: int


class Scheduler:
    """Decides, each iteration, which tokens of which sequences are computed."""

    def __init__(self, config: SchedulerConfig, sliding_window: int = 0) -> None:
        """sliding_window > 0: every layer of the model attends within a window of at most this many
        positions (ModelConfig.all_layers_windowed; the largest window): after each step the blocks
        before it are freed (KVCacheManager.free_out_of_window). 0: every block is kept."""
        config.validate()
        self.config = config
        self.kv_manager = KVCacheManager(config.num_blocks, config.block_size,
                                         config.enable_prefix_caching, sliding_window)
        self._waiting: deque[Sequence] = deque()  # new requests, add() order
        self._queued_tokens = 0  # prompt tokens of self._waiting (max_queued_tokens)
        self._preempted: list[Sequence] = []  # resume before new requests, oldest first
        self._running: list[Sequence] = []  # oldest first; the last one is preempted first
        self._seqs: dict[SeqId, Sequence] = {}  # every unfinished sequence by id
        self._rank: dict[SeqId, int] = {}  # seq_id -> add() order: what "oldest" and FCFS mean
        self._counter = itertools.count()
        self._watermark_blocks = int(config.kv_watermark * config.num_blocks)
        self._chunk_cap = config.prefill_chunk_size or config.max_num_tokens
        self._max_chunk = min(self._chunk_cap, self._prefill_token_cap())
        """The most tokens of one sequence a step computes (a prefill chunk; a verification chunk
        is kept within it under a sliding window): what a windowed sequence's KV need is counted by."""
        self._imports: list[KVImport] = []  # admitted this step with external KV
        self.num_preemptions = 0
        """Preemptions since start (max_utilization only); the one count of them (EngineStats reads
        it)."""

    # ---- queues -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        """New requests waiting for their first admission (what max_queue_size bounds)."""
        return len(self._waiting)

    @property
    def num_queued_tokens(self) -> int:
        """Their prompt tokens (what max_queued_tokens bounds)."""
        return self._queued_tokens

    def kv_need_blocks(self, seq: Sequence, max_tokens: int | None = None) -> int:
        """Most blocks `seq` can ever hold at once (with `max_tokens`, default its own): the last
        sampled token is never computed; with a sliding window, only the blocks a step can see
        are held (KVCacheManager.max_held_blocks), and a handoff is admitted with blocks for all
        its tokens from its first handed-over block (freed after its first step)."""
        kv = self.kv_manager
        positions = seq.num_prompt_tokens + (seq.max_tokens if max_tokens is None else max_tokens) - 1
        need = kv.max_held_blocks(positions, self._max_chunk)
        if seq.num_external_tokens:
            need = max(need, kv.blocks_for(seq.num_tokens) - seq.external_first_block)
        return need

    def add(self, seq: Sequence) -> None:
        """Queue a new request. ValueError for one that could never be scheduled — prompt +
        max_tokens beyond max_seq_len included: refused, never shortened; EngineOverloaded when
        the waiting queue is at max_queue_size or max_queued_tokens (`check`)."""
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self._rank[seq.seq_id] = next(self._counter)
        self._waiting.append(seq)
        self._queued_tokens += seq.num_prompt_tokens

    def check(self, seq: Sequence) -> None:
        """What `add` refuses, without queueing: a request that waits elsewhere first (its grammar
        compiling) is refused at once, and checked again when it is added."""
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in use by an unfinished request")
        n_prompt = seq.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError(f"request {seq.seq_id} has an empty prompt: at least 1 token is needed")
        if n_prompt >= cfg.max_seq_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt of {n_prompt} tokens is too long for max_seq_len="
                f"{cfg.max_seq_len} (at most {cfg.max_seq_len - 1} prompt tokens, leaving room for "
                f"one generated token); shorten the prompt or rebuild with a larger max_seq_len")
        if not 0 <= seq.num_external_tokens < seq.num_tokens:
            raise ValueError(f"request {seq.seq_id}: num_external_tokens={seq.num_external_tokens} "
                             f"must be below its {seq.num_tokens} tokens (the last is computed here)")
        self._check_external_window(seq)
        if seq.max_tokens < 1 or seq.num_output_tokens >= seq.max_tokens:
            raise ValueError(f"request {seq.seq_id}: max_tokens={seq.max_tokens} is invalid: must be "
                             f">= 1 and more than the {seq.num_output_tokens} tokens already generated")
        if n_prompt + seq.max_tokens > cfg.max_seq_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt of {n_prompt} tokens + max_tokens={seq.max_tokens} "
                f"exceeds max_seq_len={cfg.max_seq_len}; send max_tokens <= "
                f"{cfg.max_seq_len - n_prompt} for this prompt, or shorten the prompt")
        self._check_fits_pool(seq, seq.max_tokens)
        self._check_queue_room(seq)

    def _check_external_window(self, seq: Sequence) -> None:
        """A handoff may leave out only the leading blocks this engine's window never reads again."""
        first, ext = seq.external_first_block, seq.num_external_tokens
        if first == 0:
            return
        kv = self.kv_manager
        window = kv.sliding_window
        dead = max(0, ext - window + 1) // kv.block_size if window > 0 else 0
        if not 0 < first <= dead or not ext:
            raise ValueError(
                f"request {seq.seq_id}: its KV handoff starts at block {first} of {ext} tokens, but this "
                f"engine's sliding window ({window or 'none: every layer attends to the whole context'}) "
                f"still reads from block {dead}; the context and generation engines must serve the same "
                f"engine (block_size={kv.block_size})")

    def _check_queue_room(self, seq: Sequence) -> None:
        cfg = self.config
        if cfg.max_queue_size and len(self._waiting) >= cfg.max_queue_size:
            raise EngineOverloaded(
                f"server busy, retry later: {len(self._waiting)} requests are waiting for "
                f"admission (max_queue_size={cfg.max_queue_size})")
        if cfg.max_queued_tokens and self._queued_tokens + seq.num_prompt_tokens > cfg.max_queued_tokens:
            raise EngineOverloaded(
                f"server busy, retry later: {self._queued_tokens} prompt tokens are waiting for "
                f"admission and this request brings {seq.num_prompt_tokens} "
                f"(max_queued_tokens={cfg.max_queued_tokens})")

    def _check_fits_pool(self, seq: Sequence, max_tokens: int) -> None:
        cfg, kv = self.config, self.kv_manager
        need = self.kv_need_blocks(seq, max_tokens)
        if need > cfg.num_blocks:
            window = (f", sliding window {kv.sliding_window}: the blocks of one step's chunk of up to "
                      f"{self._max_chunk} tokens and its window" if kv.sliding_window else "")
            raise ValueError(
                f"request {seq.seq_id} needs up to {need} KV blocks ({seq.num_prompt_tokens} prompt "
                f"tokens + max_tokens={max_tokens}, block_size={cfg.block_size}{window}) but the pool has "
                f"only {cfg.num_blocks}; lower max_tokens or give the KV cache more memory")
        if cfg.policy == "max_utilization":
            first = kv.blocks_for(min(seq.num_tokens, self._chunk_cap, self._prefill_token_cap()))
            if first > cfg.num_blocks - self._watermark_blocks:
                raise ValueError(
                    f"request {seq.seq_id}: its first prefill chunk needs {first} KV blocks but "
                    f"kv_watermark={cfg.kv_watermark} keeps {self._watermark_blocks} of "
                    f"{cfg.num_blocks} blocks free at admission; lower kv_watermark or "
                    f"prefill_chunk_size")

    def _prefill_token_cap(self) -> int:
        cfg = self.config
        return min(cfg.max_num_tokens, cfg.prefill_max_tokens or cfg.max_num_tokens)

    # ---- one iteration ----------------------------------------------------------------------
    def decode_candidates(self) -> list[SeqId]:
        """Running sequences whose next chunk is a decode (those that may get drafts), oldest first."""
        return [seq.seq_id for seq in self._running if self._is_decode(seq)]

    def schedule(self, drafts: dict[SeqId, list[int]] | None = None) -> SchedulerOutput:
        """Build the next batch (decodes first, then prefill chunks); allocates their KV blocks.
        `drafts`: speculative decoding's proposed tokens of some running decodes (others ignored)."""
        self._check_running_not_done()
        cfg = self.config
        budget = _Budget(cfg.max_num_tokens, self._prefill_token_cap(), cfg.prefill_max_seqs)
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[SeqId] = []
        self._schedule_running(budget, decodes, prefills, preempted, drafts or {})
        if not preempted:  # admitting while evicting would only cause more evictions
            self._schedule_waiting(budget, prefills)
        chunks = decodes + prefills
        imports, self._imports = self._imports, []
        return SchedulerOutput(chunks, preempted, sum(c.num_tokens for c in chunks), imports)

    def _check_running_not_done(self) -> None:
        for seq in self._running:
            if seq.num_output_tokens >= seq.max_tokens:
                raise RuntimeError(
                    f"sequence {seq.seq_id} has generated its max_tokens={seq.max_tokens} tokens but "
                    f"is still running: the engine must call finish() before the next schedule()")

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        return seq.num_output_tokens > 0 and seq.num_uncomputed_tokens == 1

    def _schedule_running(self, budget: _Budget, decodes: list, prefills: list,
                          preempted: list, drafts: dict[SeqId, list[int]]) -> None:
        # Decodes behind a chunked prefill keep their token: prefill never starves decode.
        pending_decodes = sum(map(self._is_decode, self._running))
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            decode = self._is_decode(seq)
            extra: list[int] = []
            if decode:
                pending_decodes -= 1
                n = 1 if budget.tokens >= 1 else 0
                if n and seq.seq_id in drafts:
                    spare = budget.tokens - 1 - pending_decodes
                    if self.kv_manager.sliding_window:  # kv_need_blocks counts chunks of up to _max_chunk
                        spare = min(spare, self._max_chunk - 1)
                    extra = self._draft_room(seq, drafts[seq.seq_id], spare)
            else:
                n = self._chunk_len(seq.num_uncomputed_tokens, budget, reserve=pending_decodes)
            if n == 0:
                i += 1
                continue
            if extra and not self.kv_manager.allocate_for(seq, n + len(extra)):
                extra = []  # drafts never preempt anyone: verify nothing this step
            if not self._allocate_or_preempt(seq, n, preempted):
                break  # seq preempted itself: it was the newest, nothing is left behind it
            self._emit(seq, n, decode, budget, decodes if decode else prefills, extra)
            i += 1

    @staticmethod
    def _draft_room(seq: Sequence, drafts: list[int], spare_tokens: int) -> list[int]:
        """The drafts of a decode that fit: the spare token budget, and max_tokens (accepting all
        of them plus one token must not pass it)."""
        k = min(len(drafts), spare_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        return list(drafts[:k]) if k > 0 else []

    def _chunk_len(self, remaining: int, budget: _Budget, reserve: int = 0) -> int:
        """Tokens of a prefill of `remaining` tokens that fit this iteration (0: none)."""
        if budget.prefill_seqs == 0:
            return 0
        n = min(remaining, self._chunk_cap, budget.prefill_tokens, budget.tokens - reserve)
        if n < remaining and self.config.prefill_chunk_size == 0:
            return 0  # no chunking: the whole prompt or nothing
        return max(n, 0)

    def _allocate_or_preempt(self, seq: Sequence, n: int, preempted: list) -> bool:
        while not self.kv_manager.allocate_for(seq, n):
            victim = self._running.pop()  # the newest; never one already scheduled this step
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        bisect.insort(self._preempted, seq, key=lambda s: self._rank[s.seq_id])

    def _emit(self, seq: Sequence, n: int, decode: bool, budget: _Budget, out: list,
              drafts: list[int] | None = None) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        # Copies, so the executor side never aliases scheduler state; a decode copies one token.
        tokens = seq.token_ids(start, end)
        if drafts:
            tokens += drafts
            n += len(drafts)
        out.append(ScheduledChunk(seq.seq_id, start, n, end == seq.num_tokens, decode,
                                  tokens, list(seq.block_table), len(drafts or ())))
        budget.tokens -= n
        if not decode:
            budget.prefill_tokens -= n
            budget.prefill_seqs -= 1

    def _schedule_waiting(self, budget: _Budget, prefills: list) -> None:
        while len(self._running) < self.config.max_batch_size:
            seq = self._next_waiting()
            if seq is None or not self._try_admit(seq, budget, prefills):
                return
            if self._preempted and self._preempted[0] is seq:
                self._preempted.pop(0)
            else:
                self._leave_queue(seq)

    def _leave_queue(self, seq: Sequence) -> None:
        """Take a new request out of the waiting queue (admitted or finished)."""
        if self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)
        self._queued_tokens -= seq.num_prompt_tokens

    def _next_waiting(self) -> Sequence | None:
        if self._preempted:
            return self._preempted[0]
        if not self._waiting:
            return None
        if self.config.prefill_order == "fcfs":
            return self._waiting[0]
        return min(self._waiting, key=lambda s: (s.num_tokens, self._rank[s.seq_id]))

    def _try_admit(self, seq: Sequence, budget: _Budget, prefills: list) -> bool:
        kv = self.kv_manager
        if seq.num_external_tokens:
            return self._try_admit_external(seq, budget, prefills)
        hit = kv.find_prefix(seq)
        n = self._chunk_len(seq.num_tokens - hit.num_tokens, budget)
        if n == 0:
            return False
        new_blocks = kv.blocks_for(hit.num_tokens + n) - len(hit.blocks)
        free_after = kv.num_free_blocks - hit.num_revived - new_blocks
        if self.config.policy == "guaranteed_no_evict":
            later = self.kv_need_blocks(seq) - hit.num_live - new_blocks
            if free_after < self._promised_blocks() + later:
                return False
        elif free_after < (0 if seq.status is SequenceStatus.PREEMPTED else self._watermark_blocks):
            return False  # the watermark guards running sequences from new ones, not resumed ones
        kv.admit(seq, hit)
        if not kv.allocate_for(seq, n):
            raise RuntimeError("KV admission check passed but allocation failed (accounting bug)")
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self._running, seq, key=lambda s: self._rank[s.seq_id])
        self._emit(seq, n, False, budget, prefills)
        return True

    def _try_admit_external(self, seq: Sequence, budget: _Budget, prefills: list) -> bool:
        """Admit a sequence whose first num_external_tokens K/V are handed over: blocks for them
        plus its remaining tokens (one, in decode), which are computed in this step."""
        kv, ext = self.kv_manager, seq.num_external_tokens
        n = seq.num_tokens - ext
        if n > budget.tokens:
            return False
        new_blocks = kv.blocks_for(seq.num_tokens) - seq.external_first_block
        free_after = kv.num_free_blocks - new_blocks
        if self.config.policy == "guaranteed_no_evict":
            if free_after < self._promised_blocks() + self.kv_need_blocks(seq) - new_blocks:
                return False
        elif free_after < self._watermark_blocks:
            return False
        kv.admit(seq, PrefixHit(block_size=kv.block_size))
        if not kv.allocate_for(seq, seq.num_tokens):
            raise RuntimeError("KV admission check passed but allocation failed (accounting bug)")
        seq.num_computed_tokens = ext
        seq.num_external_tokens = seq.external_first_block = 0  # a later preemption recomputes everything
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self._running, seq, key=lambda s: self._rank[s.seq_id])
        self._imports.append(KVImport(seq.seq_id, ext, seq.block_table[seq.num_freed_blocks:kv.blocks_for(ext)],
                                      seq.num_freed_blocks))
        decode = self._is_decode(seq)
        self._emit(seq, n, decode, budget, prefills)
        return True

    def _promised_blocks(self) -> int:
        """Blocks running sequences may still take (guaranteed_no_evict reserves them)."""
        return sum(max(self.kv_need_blocks(s) - self.kv_manager.held_blocks(s), 0) for s in self._running)

    # ---- after the step ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[SeqId, int | list[int]]) -> None:
        """Apply a finished step: advance computed tokens, append sampled ids (seq_id -> token id)
        of chunks with sample=True, and index newly full blocks in the prefix cache.

        A chunk with drafts takes a list: the committed tokens (its accepted drafts, in order, then
        one token of the target's); its rejected drafts' KV slots are rolled back."""
        for chunk in out.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted after schedule(): its blocks are already freed
            if seq.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"sequence {seq.seq_id}: chunk starts at {chunk.start} but "
                    f"{seq.num_computed_tokens} tokens are computed; update() called twice?")
            if chunk.sample and seq.seq_id not in sampled:
                raise KeyError(f"no sampled token for sequence {seq.seq_id}, whose chunk has "
                               f"sample=True; pass {{seq_id: token_id}} for every such chunk")
            if not chunk.sample:
                seq.num_computed_tokens += chunk.num_tokens
            else:
                tokens = sampled[seq.seq_id]
                tokens = [tokens] if isinstance(tokens, int) else list(tokens)
                accepted = len(tokens) - 1
                drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:]
                if not 0 <= accepted <= chunk.num_draft_tokens or tokens[:accepted] != drafts[:accepted]:
                    raise ValueError(f"sequence {seq.seq_id}: committed tokens {tokens} are not a prefix "
                                     f"of its drafts {drafts} plus one token")
                seq.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens + accepted
                seq.output_token_ids.extend(tokens)
                if chunk.num_draft_tokens > accepted:
                    self.kv_manager.rollback(seq)
            self.kv_manager.cache_full_blocks(seq)
            self.kv_manager.free_out_of_window(seq)  # sliding window: blocks no later token sees

    def kv_blocks(self, seq_id: SeqId) -> tuple[list[int], int]:
        """(a copy of the block table, computed tokens) of an unfinished sequence: what a KV
        handoff exports (its leading FREED_BLOCK entries, out of the sliding window, are not)."""
        seq = self._seqs[seq_id]
        return list(seq.block_table), seq.num_computed_tokens

    def finish(self, seq_id: SeqId, status: SequenceStatus) -> None:
        """Remove a sequence (in any state) and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status}")
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"no unfinished sequence with id {seq_id}")
        if seq.status is SequenceStatus.WAITING:
            self._leave_queue(seq)
        else:
            {SequenceStatus.RUNNING: self._running,
             SequenceStatus.PREEMPTED: self._preempted}[seq.status].remove(seq)
        self.kv_manager.free(seq)
        self._rank.pop(seq_id)
        seq.status = status
