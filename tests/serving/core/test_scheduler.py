"""Scheduler rules, one test each; SchedulerConfig validation; the no-torch guarantee."""

import subprocess
import sys

import pytest

from trtforge.config.scheduler import ConfigError, SchedulerConfig
from trtforge.serving.core.scheduler import EngineOverloaded, Scheduler
from trtforge.serving.core.sequence import Sequence, SequenceStatus as S

TOKEN = 7  # what the fake model samples


class Sched(Scheduler):
    """The real scheduler; also remembers the sequences added, as the engine keeps its requests
    by the same ids (the scheduler's output carries ids, not sequences)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.seqs: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self.seqs[seq.seq_id] = seq


def make_sched(**kw):
    base = dict(max_num_tokens=64, max_batch_size=8, prefill_chunk_size=0, prefill_max_seqs=8,
                kv_watermark=0.0, max_seq_len=64, block_size=4, num_blocks=64)
    base.update(kw)
    return Sched(SchedulerConfig(**base))


def idle(sched) -> bool:
    return sched.num_running == 0 and sched.num_waiting == 0


def add(sched, seq_id, n_prompt, max_tokens=4, first_token=None):
    # distinct tokens per request unless a test shares a prefix on purpose
    first_token = seq_id * 1000 if first_token is None else first_token
    seq = Sequence(seq_id, list(range(first_token, first_token + n_prompt)), max_tokens)
    sched.add(seq)
    return seq


def step(sched):
    """schedule → fake model → update → finish at max_tokens, like the engine does."""
    out = sched.schedule()
    sched.update(out, {c.seq_id: TOKEN for c in out.chunks if c.sample})
    for c in out.chunks:
        seq = sched.seqs[c.seq_id]
        if seq.status is S.RUNNING and seq.num_output_tokens >= seq.max_tokens:
            sched.finish(c.seq_id, S.FINISHED_LENGTH)
    sched.kv_manager.check_invariants()
    return out


def shape(out):
    return [(c.seq_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


# ---- config ---------------------------------------------------------------------------------
def test_config_defaults_are_valid_and_documented():
    SchedulerConfig().validate()
    docs = SchedulerConfig.field_docs()
    import dataclasses
    assert set(docs) == {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert all(len(d) > 15 for d in docs.values())


@pytest.mark.parametrize("kw, words", [
    (dict(prefill_chunk_size=-3), ["prefill_chunk_size=-3", "0 (no chunking)", "8192"]),
    (dict(prefill_chunk_size=9000), ["prefill_chunk_size=9000", "1..max_num_tokens"]),
    (dict(max_num_tokens=0), ["max_num_tokens=0", ">= 1"]),
    (dict(max_batch_size=0), ["max_batch_size=0"]),
    (dict(prefill_max_tokens=0), ["prefill_max_tokens=0", "1..max_num_tokens"]),
    (dict(prefill_max_seqs=0), ["prefill_max_seqs=0"]),
    (dict(prefill_order="lifo"), ["prefill_order='lifo'", "fcfs, shortest_first"]),
    (dict(policy="greedy"), ["policy='greedy'", "guaranteed_no_evict"]),
    (dict(kv_watermark=0.7), ["kv_watermark=0.7", "0..0.5"]),
    (dict(max_seq_len=1), ["max_seq_len=1", ">= 2"]),
    (dict(block_size=0), ["block_size=0"]),
    (dict(num_blocks=0), ["num_blocks=0"]),
    (dict(max_num_tokens=1.5), ["max_num_tokens=1.5", "int"]),
    (dict(prefill_chunk_size=0, max_num_tokens=1000, max_seq_len=2048),
     ["max_num_tokens=1000", "no chunking", "2047"]),
    (dict(prefill_chunk_size=0, prefill_max_tokens=100, max_seq_len=512),
     ["prefill_max_tokens=100", "511"]),
])
def test_config_refuses_impossible_values_with_a_clear_message(kw, words):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kw).validate()
    for w in words:
        assert w in str(err.value)


def test_config_overrides_convert_strings_and_validate():
    cfg = SchedulerConfig().with_overrides(max_num_tokens="512", prefill_max_tokens="none",
                                           kv_watermark="0.1", enable_prefix_caching="false",
                                           policy="guaranteed_no_evict", prefill_chunk_size="256")
    assert (cfg.max_num_tokens, cfg.prefill_max_tokens, cfg.kv_watermark) == (512, None, 0.1)
    assert cfg.enable_prefix_caching is False and cfg.policy == "guaranteed_no_evict"
    with pytest.raises(ConfigError, match="unknown scheduler option 'max_tokens'"):
        SchedulerConfig().with_overrides(max_tokens=3)
    with pytest.raises(ConfigError, match="max_batch_size='lots'"):
        SchedulerConfig().with_overrides(max_batch_size="lots")
    with pytest.raises(ConfigError, match="prefill_chunk_size=9000"):
        SchedulerConfig().with_overrides(prefill_chunk_size=9000)


def test_config_coerce_judges_only_the_given_values():
    # no chunking with a 2048 budget is fine as long as the engine's max_seq_len is <= 2049,
    # which is not known yet at build time
    assert SchedulerConfig.coerce({"prefill_chunk_size": "0", "max_num_tokens": "2048"}) == {
        "prefill_chunk_size": 0, "max_num_tokens": 2048}
    with pytest.raises(ConfigError, match="max_num_tokens=1000 is too small"):
        SchedulerConfig.coerce({"prefill_chunk_size": 0, "max_num_tokens": 1000, "max_seq_len": 4096})
    with pytest.raises(ConfigError, match="kv_watermark=0.9"):
        SchedulerConfig.coerce({"kv_watermark": "0.9"})
    with pytest.raises(ConfigError, match="unknown scheduler option 'max_num_seqs'"):
        SchedulerConfig.coerce({"max_num_seqs": 4})


def test_config_for_engine_takes_limits_then_recorded_defaults_then_overrides():
    build = {"max_seq_len": 128, "kv_block_size": 16, "max_batch_size": 8}
    recorded = {"max_num_tokens": 256, "max_batch_size": 8, "prefill_chunk_size": 256,
                "block_size": 4}  # block_size is the engine's (build's), not a scheduling default
    cfg = SchedulerConfig.for_engine(build, recorded, 40, {"max_batch_size": "2"})
    assert (cfg.max_seq_len, cfg.block_size, cfg.num_blocks) == (128, 16, 40)
    assert (cfg.max_num_tokens, cfg.max_batch_size) == (256, 2)
    assert SchedulerConfig.for_engine(build, {}).num_blocks == SchedulerConfig().num_blocks
    with pytest.raises(ConfigError, match="describe the engine"):
        SchedulerConfig.for_engine(build, {}, 40, {"num_blocks": 10})
    with pytest.raises(ConfigError, match="prefill_chunk_size=256"):  # the recorded one no longer fits
        SchedulerConfig.for_engine(build, recorded, 40, {"max_num_tokens": 64})


def test_runtime_modules_do_not_import_torch():
    code = ("import sys; import trtforge.config.scheduler, trtforge.serving.core.sequence, "
            "trtforge.serving.core.block_pool, trtforge.serving.core.kv_cache_manager, "
            "trtforge.serving.core.scheduler; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- add ------------------------------------------------------------------------------------
def test_add_refuses_requests_that_can_never_run():
    sched = make_sched(max_seq_len=32, num_blocks=6)
    with pytest.raises(ValueError, match="prompt of 32 tokens is too long for max_seq_len=32"):
        add(sched, 1, 32)
    with pytest.raises(ValueError, match="empty prompt"):
        add(sched, 2, 0)
    with pytest.raises(ValueError, match="needs up to 8 KV blocks.*only 6"):
        add(sched, 3, 20, max_tokens=12)
    with pytest.raises(ValueError, match="max_tokens=13 exceeds max_seq_len=32.*<= 12"):
        add(sched, 4, 20, max_tokens=13)
    add(sched, 4, 20, max_tokens=4)  # 23 KV tokens: 6 blocks, fits
    with pytest.raises(ValueError, match="already in use"):
        add(sched, 4, 3)
    with pytest.raises(ValueError, match="max_tokens=0"):
        add(sched, 5, 3, max_tokens=0)


def test_add_refuses_prompt_plus_max_tokens_beyond_max_seq_len_instead_of_capping():
    sched = make_sched(max_seq_len=16)
    with pytest.raises(ValueError) as err:
        add(sched, 1, 10, max_tokens=99999999999999)
    assert "prompt of 10 tokens + max_tokens=99999999999999 exceeds max_seq_len=16" in str(err.value)
    assert "max_tokens <= 6" in str(err.value)
    assert idle(sched) and sched.num_queued_tokens == 0
    seq = add(sched, 1, 10, max_tokens=6)  # exactly max_seq_len: accepted as asked
    while not idle(sched):
        step(sched)
    assert seq.max_tokens == 6 and seq.num_output_tokens == 6 and seq.num_tokens == 16


def test_full_queue_refuses_at_once_and_admission_makes_room():
    sched = make_sched(max_queue_size=2, max_batch_size=1)
    running, waiting = add(sched, 1, 3, max_tokens=3), add(sched, 2, 3)
    with pytest.raises(EngineOverloaded, match=r"server busy, retry later.*max_queue_size=2"):
        add(sched, 3, 3)
    assert not isinstance(EngineOverloaded("x"), ValueError), "busy is not a bad request"
    step(sched)  # admits the first (max_batch_size=1): one place frees up
    assert sched.num_queued == 1 and running.status is S.RUNNING
    add(sched, 3, 3)
    with pytest.raises(EngineOverloaded):
        add(sched, 4, 3)
    sched.finish(waiting.seq_id, S.FINISHED_ABORTED)  # leaving the queue frees a place too
    add(sched, 4, 3)
    assert sched.num_queued == 2 and sched.num_queued_tokens == 6


def test_queued_prompt_tokens_are_bounded():
    sched = make_sched(max_queued_tokens=70, max_seq_len=64, max_batch_size=1)
    add(sched, 1, 40)
    step(sched)  # admitted: no longer queued
    add(sched, 2, 40)
    add(sched, 3, 30)
    with pytest.raises(EngineOverloaded, match=r"70 prompt tokens are waiting.*brings 1 "
                                               r"\(max_queued_tokens=70\)"):
        add(sched, 4, 1)
    assert sched.num_queued_tokens == 70
    sched.finish(2, S.FINISHED_ABORTED)
    assert sched.num_queued_tokens == 30
    add(sched, 4, 40)
    with pytest.raises(ConfigError, match="max_queued_tokens=10 is invalid.*>= max_seq_len - 1 = 63"):
        SchedulerConfig(max_queued_tokens=10, max_seq_len=64).validate()
    with pytest.raises(ConfigError, match="max_queue_size=-1"):
        SchedulerConfig(max_queue_size=-1).validate()


# ---- chunking and budgets -------------------------------------------------------------------
def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    sched = make_sched(prefill_chunk_size=4)
    add(sched, 1, 10, max_tokens=2)
    assert shape(step(sched)) == [(1, 0, 4, False)]
    assert shape(step(sched)) == [(1, 4, 4, False)]
    assert shape(step(sched)) == [(1, 8, 2, True)]
    assert shape(step(sched)) == [(1, 10, 1, True)]  # decode of the sampled token
    assert idle(sched) and sched.kv_manager.num_used_blocks == 0


def test_decodes_come_first_and_prefill_takes_the_rest_of_the_budget():
    sched = make_sched(max_num_tokens=10, prefill_chunk_size=8)
    add(sched, 1, 3, max_tokens=10)
    add(sched, 2, 3, max_tokens=10)
    step(sched)  # both prompts in one batch
    add(sched, 3, 20)
    out = step(sched)
    assert shape(out) == [(1, 3, 1, True), (2, 3, 1, True), (3, 0, 8, False)]
    assert [c.is_decode for c in out.chunks] == [True, True, False]
    assert out.num_batched_tokens == 10
    out = step(sched)  # budget 10 - 2 decodes leaves 8 for the prompt
    assert shape(out)[2] == (3, 8, 8, False)


def test_prefill_token_budget_is_separate_from_the_total():
    sched = make_sched(max_num_tokens=32, prefill_max_tokens=5, prefill_chunk_size=16)
    add(sched, 1, 12)
    add(sched, 2, 12)
    assert shape(step(sched)) == [(1, 0, 5, False)]
    assert shape(step(sched)) == [(1, 5, 5, False)]
    assert shape(step(sched)) == [(1, 10, 2, True), (2, 0, 3, False)]


def test_prefill_max_seqs_limits_prefills_but_not_decodes():
    sched = make_sched(prefill_max_seqs=2)
    for i in range(5):
        add(sched, i, 3)
    assert [c.seq_id for c in step(sched).chunks] == [0, 1]
    out = step(sched)
    assert [(c.seq_id, c.is_decode) for c in out.chunks] == [(0, True), (1, True), (2, False),
                                                                  (3, False)]


def test_max_batch_size_limits_running_sequences():
    sched = make_sched(max_batch_size=3)
    for i in range(5):
        add(sched, i, 3, max_tokens=3)
    assert len(step(sched).chunks) == 3 and sched.num_running == 3 and sched.num_waiting == 2
    step(sched)
    step(sched)  # the first three finish here
    assert [c.seq_id for c in step(sched).chunks] == [3, 4]


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it_whole():
    sched = make_sched(max_num_tokens=64, max_seq_len=64)
    add(sched, 1, 3, max_tokens=5)
    step(sched)
    add(sched, 2, 63, max_tokens=1)  # 63 tokens, but 1 decode leaves 63: fits exactly
    add(sched, 3, 2)
    out = step(sched)
    assert shape(out) == [(1, 3, 1, True), (2, 0, 63, True)]


# ---- admission order and KV limits -----------------------------------------------------------
def test_fcfs_head_that_does_not_fit_blocks_the_ones_behind():
    sched = make_sched(num_blocks=8, max_seq_len=32)
    add(sched, 1, 20, max_tokens=8)  # 5 blocks
    step(sched)
    add(sched, 2, 16, max_tokens=8)  # needs 4 blocks now, only 3 free
    add(sched, 3, 2)  # would fit, but must not overtake
    assert [c.seq_id for c in step(sched).chunks] == [1]
    assert sched.num_waiting == 2


def test_shortest_first_admits_the_short_request_first():
    sched = make_sched(num_blocks=8, max_seq_len=32, prefill_order="shortest_first")
    add(sched, 1, 20, max_tokens=8)
    step(sched)
    add(sched, 2, 16, max_tokens=8)
    add(sched, 3, 2)
    assert [c.seq_id for c in step(sched).chunks] == [1, 3]


def test_watermark_keeps_blocks_free_at_admission():
    sched = make_sched(num_blocks=10, kv_watermark=0.2, max_seq_len=40)  # keeps 2 blocks free
    add(sched, 1, 24, max_tokens=1)  # 6 blocks → 4 left
    add(sched, 2, 9, max_tokens=1)  # 3 blocks would leave 1 < 2
    assert [c.seq_id for c in step(sched).chunks] == [1]
    assert [c.seq_id for c in step(sched).chunks] == [2]  # 1 finished: room again
    with pytest.raises(ValueError, match="kv_watermark=0.2"):
        add(sched, 3, 36, max_tokens=1)  # 9 blocks > 10 - 2 for its first chunk


def test_max_utilization_preempts_the_newest_and_recomputes_it():
    sched = make_sched(num_blocks=4, max_seq_len=16, prefill_chunk_size=3,
                       enable_prefix_caching=False)
    a = add(sched, 1, 4, max_tokens=8)  # each needs 3 blocks at most: 6 > 4, so one must yield
    b = add(sched, 2, 4, max_tokens=8)
    out = step(sched)
    while b.status is S.RUNNING:
        out = step(sched)
        assert a.status is S.RUNNING
    assert out.preempted == [2] and [c.seq_id for c in out.chunks] == [1]
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert b.status is S.PREEMPTED and sched.num_waiting == 1 and sched.num_preemptions == 1
    assert sched.num_queued == 0 and sched.num_queued_tokens == 0  # max_queue_size ignores it
    outputs_before = list(b.output_token_ids)
    sched.finish(1, S.FINISHED_ABORTED)  # make room: b resumes and recomputes prompt + outputs, chunked like a prompt
    chunks = []
    while len(b.output_token_ids) == len(outputs_before):
        chunks += [(c.start, c.num_tokens, c.sample) for c in step(sched).chunks]
    total = 4 + len(outputs_before)
    assert [c[0] for c in chunks] == list(range(0, total, 3))
    assert sum(c[1] for c in chunks) == total and [c[2] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b.output_token_ids[:-1] == outputs_before


def test_shortest_first_prefill_leaves_tokens_for_the_decodes_behind_it():
    sched = make_sched(max_num_tokens=8, prefill_chunk_size=8, prefill_order="shortest_first")
    a = add(sched, 1, 20)
    c = add(sched, 2, 2)  # admitted first (shorter), but a is older: a comes first in running
    assert shape(step(sched)) == [(2, 0, 2, True), (1, 0, 6, False)]
    out = sched.schedule()  # a's chunk leaves 1 token for c's decode behind it
    assert shape(out) == [(2, 2, 1, True), (1, 6, 7, False)]
    assert a.status is c.status is S.RUNNING


def test_guaranteed_no_evict_admits_only_what_it_can_finish():
    sched = make_sched(num_blocks=7, max_seq_len=24, policy="guaranteed_no_evict")
    a = add(sched, 1, 4, max_tokens=9)  # 12 KV tokens → 3 blocks promised
    add(sched, 2, 4, max_tokens=13)  # 16 → 4 more: fills the pool
    c = add(sched, 3, 4, max_tokens=1)  # 1 block: no room until one finishes
    assert [ch.seq_id for ch in step(sched).chunks] == [1, 2]
    while a.status is S.RUNNING:
        out = step(sched)
        assert not out.preempted
        assert c.status is S.WAITING
    assert [ch.seq_id for ch in step(sched).chunks] == [2, 3]
    assert sched.num_preemptions == 0


def test_prefix_cache_hit_skips_the_shared_prefix():
    sched = make_sched(block_size=4)
    add(sched, 1, 10, max_tokens=1, first_token=0)
    step(sched)
    assert idle(sched)
    again = add(sched, 2, 10, max_tokens=1, first_token=0)  # same prompt: 2 full blocks cached, revived from free queue
    out = sched.schedule()
    assert shape(out) == [(2, 8, 2, True)]
    assert again.num_cached_prefix_tokens == 8
    assert sched.kv_manager.prefix_hit_rate == pytest.approx(8 / 20)


# ---- the output is plain data ---------------------------------------------------------------
def test_chunks_carry_copies_of_tokens_and_block_table():
    sched = make_sched(prefill_chunk_size=4)
    a = add(sched, 1, 6, max_tokens=3)
    first = step(sched).chunks[0]
    assert (first.token_ids, first.block_table) == (a.prompt_token_ids[:4], a.block_table)
    second = step(sched).chunks[0]
    assert second.token_ids == a.prompt_token_ids[4:] and second.block_table == a.block_table
    assert first.block_table == a.block_table[:1], "a later allocation changed an earlier chunk"
    decode = step(sched).chunks[0]
    assert decode.is_decode and decode.token_ids == [TOKEN] and decode.block_table == a.block_table
    for chunk in (first, second, decode):
        assert chunk.token_ids is not a.prompt_token_ids and chunk.block_table is not a.block_table
        assert not any(isinstance(v, Sequence) for v in vars(chunk).values())


def test_sequence_token_ids_slice_across_prompt_and_outputs():
    seq = Sequence(1, [10, 11, 12], 4, output_token_ids=[20, 21])
    for start in range(seq.num_tokens):
        for end in range(start, seq.num_tokens + 1):
            assert seq.token_ids(start, end) == seq.all_token_ids[start:end]


# ---- abort / finish -------------------------------------------------------------------------
def test_abort_works_in_every_state_and_frees_blocks():
    sched = make_sched(num_blocks=5, max_seq_len=20, prefill_chunk_size=4)
    waiting = add(sched, 1, 19, max_tokens=1)
    sched.finish(1, S.FINISHED_ABORTED)
    assert waiting.status is S.FINISHED_ABORTED
    prefilling = add(sched, 2, 12, max_tokens=1)
    step(sched)
    assert prefilling.status is S.RUNNING and prefilling.block_table
    sched.finish(2, S.FINISHED_ABORTED)
    assert prefilling.block_table == []
    decoding = add(sched, 3, 3, max_tokens=8)
    victim = add(sched, 4, 3, max_tokens=8)
    step(sched)
    while victim.status is not S.PREEMPTED:
        step(sched)
    sched.finish(4, S.FINISHED_ABORTED)
    assert sched.num_waiting == 0
    sched.finish(3, S.FINISHED_ABORTED)
    assert decoding.status is S.FINISHED_ABORTED
    for gone in (3, 99):
        with pytest.raises(ValueError, match=f"no unfinished sequence with id {gone}"):
            sched.finish(gone, S.FINISHED_ABORTED)
    assert idle(sched) and sched.kv_manager.num_used_blocks == 0
    sched.kv_manager.check_invariants()


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make_sched()
    a = add(sched, 1, 5)
    out = sched.schedule()
    sched.finish(1, S.FINISHED_ABORTED)
    sched.update(out, {1: TOKEN})
    assert a.output_token_ids == [] and sched.kv_manager.num_used_blocks == 0


def test_engine_errors_are_explained():
    sched = make_sched()
    add(sched, 1, 5, max_tokens=1)
    out = sched.schedule()
    with pytest.raises(KeyError, match="no sampled token for sequence 1"):
        sched.update(out, {})
    sched.update(out, {1: TOKEN})
    with pytest.raises(RuntimeError, match="update\\(\\) called twice"):
        sched.update(out, {1: TOKEN})
    with pytest.raises(RuntimeError, match="must call finish"):
        sched.schedule()
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish(1, S.RUNNING)
