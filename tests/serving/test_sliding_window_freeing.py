"""A model whose every layer is windowed (Mistral, sliding_window 16) serves sequences far longer than its window
at constant KV per sequence: the engine frees the blocks before the window after each step. Greedy tokens equal
transformers' model run on the whole sequence (its eager attention applies the window); the blocks held stay
bounded; nothing leaks; a pool too small for the whole sequence but big enough for the window serves it; prefix
caching, KV events, preemption, speculative decoding and the disaggregated handoff stay exact next to freed blocks."""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

from tests.helpers.checkpoints import make_variant
from tests.serving.spec_decode.test_greedy import ReferenceProposer
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.core.kv_cache_manager import FREED_BLOCK
from trtforge.serving.core.kv_events import BlockRemoved, BlockStored
from trtforge.serving.core.scheduler import ScheduledChunk, SchedulerOutput
from trtforge.serving.engine import LLMEngine
from trtforge.serving.kv_connector import KVHandle
from trtforge.serving.kv_connector.shared_memory import live_blocks
from trtforge.serving.spec_decode.controller import SpecDecodeController
from trtforge.serving.worker.model_inputs import prepare_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW, BLOCK, CHUNK = 16, 4, 4
MAX_NEW = 72  # with 23..50-token prompts: sequences of 95..122 tokens, 6-7 windows long
BOUND = math.ceil(WINDOW / BLOCK) + 2  # blocks one sequence may hold (chunks of CHUNK tokens: 6)
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
MAX_STEPS = 5000  # a stalled scheduler fails the test instead of hanging it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(engine dir, checkpoint, KV bytes per block, the oracle: prompt -> greedy tokens)."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("swa")
    ckpt = make_variant(tmp / "ckpt", "mistral-mqa", sliding_window=WINDOW)
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64, kv_block_size=BLOCK,
                                      kv_cache_memory="1MiB"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def oracle(prompt: list[int], n: int = MAX_NEW) -> list[int]:
        """transformers on the whole sequence at every step (not `generate`: see test_parity_sliding_window)."""
        key = tuple(prompt)
        if len(cache.get(key, ())) < n:
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(n):
                    ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            cache[key] = ids[len(prompt):]
        return cache[key][:n]

    engine = LLMEngine.from_engine_dir(out)
    assert engine.engine_config.model.kv_window == WINDOW and engine.scheduler.kv_manager.sliding_window == WINDOW
    block_bytes = kv_bytes_per_token(engine.engine_config.model, "float32") * BLOCK
    return out, ckpt, block_bytes, oracle


def prompts(n: int, lengths=(40, 23, 37, 50)) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 500, (length,), generator=g).tolist() for length in lengths[:n]]


def make(model, blocks: int, phase: str = "both", speculative: SpeculativeConfig | None = None,
         connector: dict | None = None, **scheduling) -> LLMEngine:
    engine_dir, _, block_bytes, _ = model
    runtime = RuntimeConfig(kv_cache_memory=blocks * block_bytes, phase=phase, handoff_timeout_s=30,
                            speculative_config=speculative, **(connector or {}))
    engine = LLMEngine.from_engine_dir(engine_dir, runtime, **{"prefill_chunk_size": CHUNK, **scheduling})
    assert engine.scheduler_config.num_blocks == blocks
    return engine


def watch_peak(engine: LLMEngine) -> list[int]:
    """[the most KV blocks in use while a step ran], kept up to date: read when the executor is called, after the
    step's blocks are allocated and before the ones out of the window are freed."""
    peak, kv, execute = [0], engine.scheduler.kv_manager, engine.executor.execute

    def counted(inputs):
        peak[0] = max(peak[0], kv.num_used_blocks)
        return execute(inputs)

    engine.executor.execute = counted
    return peak


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams = GREEDY) -> tuple[list[list[int]], int]:
    """(each prompt's generated tokens, the most KV blocks in use during any step); checks the block accounting
    after every step."""
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(batch)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    kv, peak = engine.scheduler.kv_manager, watch_peak(engine)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
    assert not engine.has_unfinished(), f"no progress after {MAX_STEPS} steps"
    assert kv.num_used_blocks == 0, "KV blocks leaked"
    return [tokens[rid] for rid in ids], peak[0]


def test_generates_far_past_its_window_at_constant_kv(model):
    oracle = model[3]
    engine = make(model, blocks=64)
    for prompt in prompts(2):
        (got,), peak = run(engine, [prompt])
        assert got == oracle(prompt), f"greedy tokens differ for a {len(prompt)}-token prompt"
        assert peak <= BOUND, f"{peak} blocks held by one {len(prompt) + MAX_NEW}-token sequence (bound {BOUND})"
        assert math.ceil((len(prompt) + MAX_NEW) / BLOCK) > 3 * BOUND  # the whole sequence would need far more


def test_a_pool_too_small_for_the_sequence_but_big_enough_for_its_window_serves_it(model):
    oracle = model[3]
    prompt = prompts(1)[0]
    engine = make(model, blocks=BOUND)  # 6 blocks = 24 tokens for a 112-token sequence
    (got,), peak = run(engine, [prompt])
    assert got == oracle(prompt) and peak <= BOUND
    # What does not fit even its window is refused, saying why.
    tiny = make(model, blocks=BOUND - 2)
    with pytest.raises(ValueError, match="sliding window 16.*pool has only 4"):
        tiny.add_request(prompt, GREEDY)


def test_prefix_cache_hit_after_freeing_is_exact(model):
    """The second request with the same prompt revives the cached blocks its window sees (not the dead ones before
    it) and continues the chain; a third shares only the prompt's first blocks."""
    oracle = model[3]
    prompt = prompts(1)[0]
    engine = make(model, blocks=64)
    (first,), _ = run(engine, [prompt])
    kv = engine.scheduler.kv_manager
    hit = kv.find_prefix(_seq(prompt))
    assert len(hit.blocks) == (len(prompt) - 1) // BLOCK and hit.num_dead > 0  # cached before they were freed
    engine.add_request(prompt, GREEDY, request_id="again")
    got, cached, peak = [], None, watch_peak(engine)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got.extend(out.new_token_ids)
            cached = out.num_cached_tokens
        kv.check_invariants()
    assert cached == len(hit.blocks) * BLOCK and got == first == oracle(prompt)
    assert peak[0] <= BOUND, f"{peak[0]} blocks held: the dead hit blocks before the window were revived"
    other = prompt[:20] + prompts(4)[3][:25]
    (got,), _ = run(engine, [other])
    assert got == oracle(other)


def _seq(prompt):
    from trtforge.serving.core.sequence import Sequence

    return Sequence(seq_id="probe", prompt_token_ids=list(prompt), max_tokens=1)


def test_kv_events_store_then_remove_each_block_once(model):
    """Blocks freed out of the window stay announced (revivable) until their memory is reused; every BlockRemoved
    follows the BlockStored of its key, once, and what stays announced is what the prefix cache holds."""
    engine = make(model, blocks=16)
    log = engine.scheduler.kv_manager.enable_events()
    batch = prompts(4)
    run(engine, batch + [batch[0]])
    announced: Counter = Counter()
    stored = removed = 0
    for event in log.drain():
        if isinstance(event, BlockStored):
            assert announced[event.key] == 0, "a block stored twice without its removal"
            announced[event.key] += 1
            stored += 1
        else:
            assert isinstance(event, BlockRemoved) and announced[event.key] == 1, "removed but never stored"
            announced[event.key] -= 1
            removed += 1
    assert log.dropped == 0 and removed > 0 and stored > removed
    assert sum(announced.values()) == engine.scheduler.kv_manager.num_cached_blocks


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_concurrent_sequences_with_preemption(model, policy):
    oracle = model[3]
    batch = prompts(4)
    engine = make(model, blocks=2 * BOUND + 1, policy=policy)  # room for two windows at once, four requests
    got, peak = run(engine, batch)
    for prompt, tokens in zip(batch, got):
        assert tokens == oracle(prompt), f"{policy}: greedy tokens differ for a {len(prompt)}-token prompt"
    preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0 if policy == "max_utilization" else preemptions == 0
    assert peak <= 2 * BOUND + 1


def test_speculative_decoding_next_to_freed_blocks(model):
    """Verification chunks past the window, and rollbacks of rejected drafts there: drafts from the known
    continuation, every third proposal's third draft wrong. Tokens as one-token greedy, blocks bounded."""
    oracle = model[3]
    prompt = prompts(2)[1]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=None, backoff_after_rejections=0)
    engine = make(model, blocks=64, speculative=spec)
    engine.spec = SpecDecodeController(spec, ReferenceProposer({"r0": prompt + oracle(prompt)}))
    (got,), peak = run(engine, [prompt])
    assert got == oracle(prompt)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # accepts and rollbacks
    assert peak <= math.ceil((WINDOW + CHUNK + BLOCK - 2) / BLOCK)  # drafts stay within the chunk cap


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disaggregated_handoff_sends_only_the_blocks_in_the_window(model, tmp_path, transport):
    """The context side's prefill of a prompt longer than the window frees the blocks before it; the handoff
    carries the rest (first_block says where they start) and the generation side continues exactly."""
    oracle = model[3]
    batch = prompts(3)
    sides: dict[str, dict] = {"context": {}, "generation": {}}
    if transport == "tcp":
        key = tmp_path / "kv.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        sides = {"context": dict(kv_connector="tcp://127.0.0.1:0", kv_auth_key_file=str(key)),
                 "generation": dict(kv_peers="127.0.0.1", kv_auth_key_file=str(key))}
    ctx = make(model, blocks=64, phase="context", connector=sides["context"])
    gen = make(model, blocks=64, phase="generation", connector=sides["generation"])
    try:
        first: dict[str, int] = {}
        handles: dict[str, KVHandle] = {}
        for i, p in enumerate(batch):
            ctx.add_request(p, GREEDY, request_id=f"r{i}")
        while ctx.has_unfinished():
            for out in ctx.step():
                first[out.request_id] = out.new_token_ids[0]
                handles[out.request_id] = KVHandle.from_json(out.kv_handle.to_json())
        for i, p in enumerate(batch):
            handle = handles[f"r{i}"]
            dead = max(0, len(p) - WINDOW + 1) // BLOCK
            assert handle.first_block == dead > 0 and len(handle.blocks) == math.ceil(len(p) / BLOCK) - dead
            gen.add_handoff(handle, GREEDY, request_id=f"r{i}")
        tokens = {f"r{i}": [first[f"r{i}"]] for i in range(len(batch))}
        peak = watch_peak(gen)
        for _ in range(MAX_STEPS):
            if not gen.has_unfinished():
                break
            for out in gen.step():
                assert out.error is None, out.error
                tokens[out.request_id].extend(out.new_token_ids)
            gen.scheduler.kv_manager.check_invariants()
        for i, p in enumerate(batch):
            assert tokens[f"r{i}"] == oracle(p), f"handoff of a {len(p)}-token prompt: tokens differ"
        assert peak[0] <= len(batch) * BOUND
        for engine in (ctx, gen):
            engine.poll()
            stats = engine.stats()
            assert stats.kv_blocks_used == 0 and stats.kv_handoff_blocks_held == 0
        assert gen.stats().kv_handoff_bytes_total == ctx.stats().kv_handoff_bytes_total
    finally:
        ctx.close()


def test_model_inputs_never_carry_a_freed_entry():
    table = [FREED_BLOCK, FREED_BLOCK, 5, 2, 9]
    decode = ScheduledChunk(seq_id=1, start=18, num_tokens=1, sample=True, is_decode=True, token_ids=[4],
                            block_table=table)
    other = ScheduledChunk(seq_id=2, start=0, num_tokens=3, sample=True, is_decode=False, token_ids=[1, 2, 3],
                           block_table=[7])
    inputs = prepare_inputs(SchedulerOutput(chunks=[decode, other]), BLOCK)
    assert inputs.meta.block_tables.tolist() == [[0, 0, 5, 2, 9], [7, 0, 0, 0, 0]]
    assert inputs.meta.slot_mapping.tolist() == [9 * BLOCK + 2, 28, 29, 30]
    bad = ScheduledChunk(seq_id=3, start=5, num_tokens=1, sample=True, is_decode=True, token_ids=[4],
                         block_table=table)
    with pytest.raises(RuntimeError, match="freed out of the sliding window"):
        prepare_inputs(SchedulerOutput(chunks=[bad]), BLOCK)


def test_handoff_export_sends_the_live_blocks_only():
    assert live_blocks([FREED_BLOCK, FREED_BLOCK, 4, 8]) == (2, [4, 8])
    assert live_blocks([3, 1]) == (0, [3, 1])
    for table in ([3, FREED_BLOCK, 1], [FREED_BLOCK, FREED_BLOCK]):
        with pytest.raises(ValueError, match="cannot hand over"):
            live_blocks(table)


def test_tensor_parallel_ranks_never_see_a_freed_entry(model, tmp_path):
    """Two gloo ranks (the one KV head replicated on both): each step's block tables cross to rank 1 in a message
    whose ids are bounds-checked, so a freed (-1) entry would fail the step; the tokens are the oracle's."""
    _, ckpt, block_bytes, oracle = model
    out, _ = build_engine(str(ckpt), tmp_path / "tp2",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64, kv_block_size=BLOCK,
                                      kv_cache_memory="1MiB", tp_size=2), progress=False)
    engine = LLMEngine.from_engine_dir(out, RuntimeConfig(kv_cache_memory=BOUND * block_bytes),
                                       prefill_chunk_size=CHUNK)
    try:
        assert engine.scheduler_config.num_blocks == BOUND
        prompt = prompts(1)[0]
        (got,), peak = run(engine, [prompt])
        assert got == oracle(prompt) and peak <= BOUND
    finally:
        engine.executor.close()
