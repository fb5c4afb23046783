"""Randomized stress test: thousands of requests through the real scheduler and KV cache manager.

The "model" is a simulated paged KV cache: for every scheduled chunk it writes the chunk's token ids
into the slots named by the chunk's copy of the block table (what an executor gets), then reads back
every position the chunk attends to and checks it holds the sequence's token there. So a wrong block
table, a prefix hit on the wrong block, a block written while shared, or a recompute that skips a
token fails here, not in a GPU kernel later.
Sampled tokens are random; a sequence finishes on max_tokens, on a stop token, or by abort.
"""

import random

import pytest

from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.core.scheduler import Scheduler
from trtforge.serving.core.sequence import Sequence, SequenceStatus as S

BS, MAX_SEQ_LEN, VOCAB, STOP = 4, 48, 50, 0
COMMON = dict(max_seq_len=MAX_SEQ_LEN, block_size=BS, num_blocks=24, max_num_tokens=48,
              max_batch_size=6, prefill_max_seqs=2, kv_watermark=0.05)
CASES = {
    "maxutil-fcfs-chunked": dict(policy="max_utilization", prefill_order="fcfs",
                                 prefill_chunk_size=8, prefill_max_tokens=20),
    "maxutil-shortest-whole": dict(policy="max_utilization", prefill_order="shortest_first",
                                   prefill_chunk_size=0),
    "noevict-fcfs-chunked": dict(policy="guaranteed_no_evict", prefill_order="fcfs",
                                 prefill_chunk_size=5, prefill_max_tokens=12),
    "noevict-shortest-nocache": dict(policy="guaranteed_no_evict", prefill_order="shortest_first",
                                     prefill_chunk_size=16, enable_prefix_caching=False),
}
NUM_REQUESTS = 600
MAX_STEPS = 20_000


class Driver:
    """Plays the engine: adds requests over time, runs the fake model, finishes and aborts."""

    def __init__(self, cfg: SchedulerConfig, seed: int) -> None:
        self.cfg, self.rng = cfg, random.Random(seed)
        self.sched = Scheduler(cfg)
        self.prefixes = [[self.rng.randrange(1, VOCAB) for _ in range(n)] for n in (4, 8, 13, 20)]
        self.kv_slots: dict[int, list] = {}  # block id -> token id written in each slot
        self.all: list[Sequence] = []
        self.live: dict[int, Sequence] = {}  # unfinished requests by id
        self.rank: dict[int, int] = {}
        self.never_admitted: set[int] = set()
        self.last_admitted_rank = -1
        self.expected_outputs: dict[int, list[int]] = {}
        self.abort_states: set[S] = set()

    def new_request(self) -> None:
        rng, seq_id = self.rng, len(self.all)
        if self.all and rng.random() < 0.1:  # a repeated prompt: a hit on every full block
            prompt = list(rng.choice(self.all).prompt_token_ids)
        else:
            prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.5 else []
            # tokens from {1, 2} make equal blocks behind different prefixes common: only the
            # chained hash tells them apart
            vocab = 3 if rng.random() < 0.3 else VOCAB
            prompt += [rng.randrange(1, vocab) for _ in range(rng.randint(1, 24))]
        prompt = prompt[:MAX_SEQ_LEN - 1]
        seq = Sequence(seq_id, prompt, max_tokens=min(rng.randint(1, 20), MAX_SEQ_LEN - len(prompt)))
        self.sched.add(seq)
        self.all.append(seq)
        self.live[seq_id] = seq
        self.rank[seq_id] = seq_id
        self.never_admitted.add(seq_id)
        self.expected_outputs[seq_id] = []

    def abort_random(self) -> None:
        live = list(self.live.values())
        preempted = [s for s in live if s.status is S.PREEMPTED]
        live = preempted if preempted and self.rng.random() < 0.5 else live  # a rare, short state
        if live:
            seq = self.rng.choice(live)
            self.abort_states.add(seq.status)
            self.sched.finish(seq.seq_id, S.FINISHED_ABORTED)
            del self.live[seq.seq_id]
            self.never_admitted.discard(seq.seq_id)

    def run_model(self, out) -> dict[int, int]:
        pool = self.sched.kv_manager.pool
        sampled = {}
        for c in out.chunks:
            seq, tokens = self.all[c.seq_id], self.all[c.seq_id].all_token_ids
            assert c.token_ids == tokens[c.start:c.start + c.num_tokens]
            assert c.block_table == seq.block_table and c.block_table is not seq.block_table
            for pos, token in enumerate(c.token_ids, c.start):  # write the new K/V
                block = c.block_table[pos // BS]
                assert pool.ref_counts[block] == 1, "writing into a shared block"
                self.kv_slots.setdefault(block, [None] * BS)[pos % BS] = token
            end = c.start + c.num_tokens  # attention reads every position up to the last new one
            for i in range(-(-end // BS)):
                got = self.kv_slots.get(c.block_table[i], [None] * BS)
                want = tokens[i * BS:min(end, (i + 1) * BS)]
                assert got[:len(want)] == want, f"seq {seq.seq_id} reads wrong K/V in block {i}"
            if c.sample:
                sampled[seq.seq_id] = self.rng.randrange(VOCAB)
        return sampled

    def check_batch(self, out, before: dict[int, tuple]) -> None:
        cfg, chunks = self.cfg, out.chunks
        assert out.num_batched_tokens == sum(c.num_tokens for c in chunks) <= cfg.max_num_tokens
        assert len(chunks) <= cfg.max_batch_size and self.sched.num_running <= cfg.max_batch_size
        assert len({c.seq_id for c in chunks}) == len(chunks)
        flags = [c.is_decode for c in chunks]
        assert flags == sorted(flags, reverse=True), "decodes must come before prefill chunks"
        prefill = [c for c in chunks if not c.is_decode]
        assert sum(c.num_tokens for c in prefill) <= (cfg.prefill_max_tokens or cfg.max_num_tokens)
        assert len(prefill) <= cfg.prefill_max_seqs
        for c in chunks:
            seq = self.all[c.seq_id]
            computed, num_tokens, n_out = before[seq.seq_id]
            assert c.start == seq.num_computed_tokens and c.num_tokens >= 1
            assert c.start + c.num_tokens <= seq.num_tokens <= MAX_SEQ_LEN
            assert c.sample == (c.start + c.num_tokens == seq.num_tokens)
            if c.is_decode:
                assert c.num_tokens == 1 and c.sample and n_out > 0
            elif cfg.prefill_chunk_size:
                assert c.num_tokens <= cfg.prefill_chunk_size
            else:
                assert c.sample, "without chunking a prefill is computed whole"
        for seq_id in out.preempted:
            seq = self.all[seq_id]
            assert seq.status is S.PREEMPTED and seq.block_table == [] and seq.num_computed_tokens == 0
            assert all(c.seq_id != seq_id for c in chunks)
        if cfg.policy == "guaranteed_no_evict":
            assert not out.preempted
        if self.sched.num_running + self.sched.num_waiting:
            assert not out.is_empty, "work is pending but nothing was scheduled (deadlock)"
        self.check_admission_order(chunks)

    def check_admission_order(self, chunks) -> None:
        admitted = [self.all[c.seq_id] for c in chunks if c.seq_id in self.never_admitted]
        for seq in admitted:
            self.never_admitted.discard(seq.seq_id)
        if self.cfg.prefill_order == "fcfs":  # first admissions in add() order, none skipped
            for seq in admitted:
                assert self.rank[seq.seq_id] > self.last_admitted_rank
                self.last_admitted_rank = self.rank[seq.seq_id]
        elif admitted and self.never_admitted:  # shortest_first: none shorter left waiting
            longest = max(s.num_prompt_tokens for s in admitted)
            assert longest <= min(self.all[i].num_prompt_tokens for i in self.never_admitted)

    def finish_done(self, out, sampled: dict[int, int]) -> None:
        for c in out.chunks:
            seq = self.all[c.seq_id]
            if not c.sample or seq.status is not S.RUNNING:
                continue
            self.expected_outputs[seq.seq_id].append(sampled[seq.seq_id])
            if seq.num_output_tokens >= seq.max_tokens:
                self.sched.finish(seq.seq_id, S.FINISHED_LENGTH)
            elif sampled[seq.seq_id] == STOP:
                self.sched.finish(seq.seq_id, S.FINISHED_STOPPED)

    def step(self) -> None:
        rng, sched = self.rng, self.sched
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            if len(self.all) < NUM_REQUESTS:
                self.new_request()
        if rng.random() < 0.03:
            self.abort_random()
        before = {s.seq_id: (s.num_computed_tokens, s.num_tokens, s.num_output_tokens)
                  for s in self.live.values()}
        out = sched.schedule()
        self.check_batch(out, before)
        sampled = self.run_model(out)
        if out.chunks and rng.random() < 0.02:  # a client cancels while the step runs
            victim = self.all[rng.choice(out.chunks).seq_id]
            self.abort_states.add(victim.status)
            sched.finish(victim.seq_id, S.FINISHED_ABORTED)
            del self.live[victim.seq_id]
        sched.update(out, sampled)
        self.finish_done(out, sampled)
        sched.kv_manager.check_invariants()
        self.live = {i: s for i, s in self.live.items() if not s.is_finished}
        assert sched.num_running + sched.num_waiting == len(self.live)


@pytest.mark.parametrize("case", list(CASES))
def test_random_workload_finishes_everything_without_leaks(case):
    cfg = SchedulerConfig(**COMMON, **CASES[case])
    drv = Driver(cfg, seed=sorted(CASES).index(case) + 1)
    steps = 0
    while len(drv.all) < NUM_REQUESTS or drv.sched.num_running + drv.sched.num_waiting:
        drv.step()
        steps += 1
        assert steps < MAX_STEPS, f"not finished after {steps} steps"
    kv = drv.sched.kv_manager
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == cfg.num_blocks, "KV blocks leaked"
    kv.check_invariants()
    for seq in drv.all:
        assert seq.is_finished and seq.block_table == []
        assert seq.output_token_ids == drv.expected_outputs[seq.seq_id]
        if seq.status is S.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.max_tokens
        assert seq.num_tokens <= MAX_SEQ_LEN
    # the run must have exercised what it claims to test
    assert {S.WAITING, S.RUNNING} <= drv.abort_states
    if cfg.policy == "max_utilization":
        assert drv.sched.num_preemptions > 0 and S.PREEMPTED in drv.abort_states
    else:
        assert drv.sched.num_preemptions == 0
    if cfg.enable_prefix_caching:
        assert kv.num_hit_tokens > 0 and kv.pool.num_evictions > 0
