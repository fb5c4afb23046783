"""In-flight batching must not change what a request generates.

Each request is first run ALONE on a roomy engine (whole prompt in one step, no other sequence, no
prefix cache); then all of them run together on a cramped engine: requests arrive at random steps
while others decode, prompts are split into small random chunks under a small token budget, and a
tiny KV pool forces preemption (recompute). Greedy tokens — and seeded random samples — must be the
same. The schedule is recorded from the real scheduler so the test proves chunking, mixing and
preemption actually happened (it cannot pass vacuously on an idle engine).
"""

from __future__ import annotations

import random

import pytest

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.engine import LLMEngine
from trtforge.serving.outputs import RequestOutput

BLOCK = 4
TIE_GAP = 1e-4  # logprob gap under which two tokens count as tied (fp32 reduction-order noise)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ifb")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=256,
                                      max_seq_len=256, kv_block_size=BLOCK, kv_cache_memory="1MiB"),
                          progress=False)
    return out


def kv_bytes(engine_dir, blocks: int) -> int:
    """KV memory that buys exactly `blocks` blocks of this engine."""
    cfg = LLMEngine.from_engine_dir(engine_dir).engine_config
    return blocks * kv_bytes_per_token(cfg.model, cfg.dtype) * cfg.block_size


def random_requests(rng: random.Random, n: int, vocab: int, **params) -> list[tuple[list[int], SamplingParams]]:
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        reqs.append((prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, **params)))
    return reqs


def run_alone(engine_dir, requests) -> list[RequestOutput]:
    """Each request by itself: one prefill step, then plain decode steps."""
    engine = LLMEngine.from_engine_dir(engine_dir, enable_prefix_caching=False, prefill_chunk_size=0)
    return [generate_all(engine, [prompt], SamplingParams(**{**vars(params), "logprobs": 2}))[0]
            for prompt, params in requests]


def generate_all(engine: LLMEngine, prompts, params: SamplingParams) -> list[RequestOutput]:
    """Run prompts together; final outputs carry the (top) logprobs of all their steps."""
    rids = [engine.add_request(p, params) for p in prompts]
    steps: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            steps[out.request_id].append(out)
    finals = []
    for rid in rids:
        final = steps[rid][-1]
        assert final.finished
        final.logprobs = [lp for o in steps[rid] for lp in o.logprobs or []]
        final.top_logprobs = [t for o in steps[rid] for t in o.top_logprobs or []]
        finals.append(final)
    return finals


def record_schedules(engine: LLMEngine) -> list[list[tuple[int, bool, bool]]]:
    """Log (num_tokens, sample, is_decode) of every chunk the real scheduler emits."""
    log: list[list[tuple[int, bool, bool]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        log.append([(c.num_tokens, c.sample, c.is_decode) for c in out.chunks])
        return out

    engine.scheduler.schedule = recording
    return log


def run_busy(engine: LLMEngine, requests, rng: random.Random) -> list[RequestOutput]:
    """Submit requests in random order at random steps while the engine runs the others."""
    order = list(range(len(requests)))
    rng.shuffle(order)
    index_of: dict[str, int] = {}
    final: dict[int, RequestOutput] = {}
    while order or engine.has_unfinished():
        while order and (not engine.has_unfinished() or rng.random() < 0.3):
            i = order.pop()
            index_of[engine.add_request(*requests[i])] = i
        for out in engine.step():
            if out.finished:
                final[index_of[out.request_id]] = out
    engine.scheduler.kv_manager.check_invariants()
    assert engine.stats().kv_blocks_used == 0, "finished requests left KV blocks allocated"
    return [final[i] for i in range(len(requests))]


def assert_greedy_same(alone: RequestOutput, busy: RequestOutput, what: str) -> None:
    """Identical tokens; a divergence is accepted only at an exact tie of the alone run's top two
    tokens (fp32 sums in another order), where the busy run must have taken the runner-up."""
    for pos, (a, b) in enumerate(zip(alone.output_token_ids, busy.output_token_ids)):
        if a != b:
            top = alone.top_logprobs[pos]
            gap = top[0][1] - top[1][1]
            assert b == top[1][0] and gap < TIE_GAP, (
                f"{what}: token {pos} is {b} in the batch but {a} alone (top-2 gap {gap:.2e}): "
                f"alone {alone.output_token_ids}, batched {busy.output_token_ids}")
            return
    assert len(alone.output_token_ids) == len(busy.output_token_ids), what


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_inflight_batching_matches_alone(engine_dir, seed):
    rng = random.Random(seed)
    vocab = LLMEngine.from_engine_dir(engine_dir).engine_config.model.vocab_size
    requests = random_requests(rng, 12, vocab)
    alone = run_alone(engine_dir, requests)

    chunk = rng.randint(2, 7)
    engine = LLMEngine.from_engine_dir(
        engine_dir, RuntimeConfig(kv_cache_memory=kv_bytes(engine_dir, 18 + rng.randint(0, 4))),
        prefill_chunk_size=chunk, max_num_tokens=chunk + rng.randint(2, 10),
        policy="max_utilization", enable_prefix_caching=bool(seed % 2))
    log = record_schedules(engine)
    busy = run_busy(engine, requests, rng)

    for i, (a, b) in enumerate(zip(alone, busy)):
        assert b.finish_reason == "length", f"request {i}: {b.finish_reason} {b.error}"
        assert_greedy_same(a, b, f"seed {seed} request {i}")
    assert engine.stats().num_preemptions > 0, "the KV pool was meant to force preemption"
    budget = engine.scheduler_config.max_num_tokens
    assert all(sum(n for n, _, _ in step) <= budget for step in log)
    partial = [c for step in log for c in step if not c[2] and not c[1]]
    assert partial, "no prompt was split into chunks"
    mixed = [step for step in log if any(d for _, _, d in step) and not all(d for _, _, d in step)]
    assert mixed, "no step mixed decode tokens with prefill chunks"


def test_seeded_sampling_same_alone_and_in_busy_batch(engine_dir):
    rng = random.Random(7)
    vocab = LLMEngine.from_engine_dir(engine_dir).engine_config.model.vocab_size
    requests = random_requests(rng, 10, vocab, temperature=0.8, top_p=0.9)
    for i, (_, params) in enumerate(requests):
        params.seed = 1000 + i
    alone = run_alone(engine_dir, requests)
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=kv_bytes(engine_dir, 18)),
                                       prefill_chunk_size=5, max_num_tokens=12)
    busy = run_busy(engine, requests, rng)
    assert engine.stats().num_preemptions > 0
    for i, (a, b) in enumerate(zip(alone, busy)):
        assert a.output_token_ids == b.output_token_ids, f"seeded request {i} changed in a batch"
    distinct = {tuple(o.output_token_ids) for o in alone if len(o.output_token_ids) > 3}
    assert len(distinct) > 1, "sampling produced the same tokens everywhere: not really random"


def test_prefix_caching_does_not_change_greedy_outputs(engine_dir):
    rng = random.Random(3)
    vocab = LLMEngine.from_engine_dir(engine_dir).engine_config.model.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(45)]  # 11 full blocks and a partial one
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 9))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for caching in (False, True):
        engine = LLMEngine.from_engine_dir(engine_dir, enable_prefix_caching=caching, prefill_chunk_size=16)
        # The first prompt alone fills the cache, then the others arrive together.
        results[caching] = generate_all(engine, prompts[:1], params) + generate_all(engine, prompts[1:], params)
        hits = engine.scheduler.kv_manager.num_hit_tokens
        assert (hits > 0) == caching, f"prefix caching {caching}: {hits} tokens hit"
    assert hits >= 5 * (len(shared) // BLOCK) * BLOCK, f"only {hits} tokens served from the cache"
    for i, (off, on) in enumerate(zip(results[False], results[True])):
        assert_greedy_same(off, on, f"prefix-cached prompt {i}")


@pytest.mark.parametrize("seed", [3, 4])
def test_greedy_speculative_busy_batch_matches_alone(engine_dir, seed):
    """Speculative decoding (ngram) under the same pressure — random arrivals, small chunks and
    budget, preemption — still gives every request its plain-decoding tokens, and leaks nothing."""
    from trtforge.config.speculative import SpeculativeConfig

    rng = random.Random(seed)
    vocab = LLMEngine.from_engine_dir(engine_dir).engine_config.model.vocab_size
    requests = []
    for prompt, params in random_requests(rng, 10, vocab):
        params.max_tokens = rng.randint(8, 24)
        requests.append((prompt + prompt[:rng.randint(1, 8)], params))  # something to look up
    alone = run_alone(engine_dir, requests)
    spec = SpeculativeConfig(num_speculative_tokens=rng.randint(2, 5), prompt_lookup_min=1,
                             disable_by_batch_size=None, backoff_after_rejections=0)
    chunk = rng.randint(2, 7)
    runtime = RuntimeConfig(kv_cache_memory=kv_bytes(engine_dir, 18 + rng.randint(0, 4)), speculative_config=spec)
    engine = LLMEngine.from_engine_dir(
        engine_dir, runtime,
        prefill_chunk_size=chunk, max_num_tokens=chunk + rng.randint(4, 10), policy="max_utilization",
        enable_prefix_caching=bool(seed % 2))
    busy = run_busy(engine, requests, rng)
    for i, (a, b) in enumerate(zip(alone, busy)):
        assert b.finish_reason == "length", f"request {i}: {b.finish_reason} {b.error}"
        assert_greedy_same(a, b, f"seed {seed} request {i}")
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.spec_decode_num_draft_tokens > 0
