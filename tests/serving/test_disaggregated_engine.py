"""Disaggregated serving in one process: a `context` engine computes the prompt and the first
token and hands the KV over (shared memory); a `generation` engine continues. Text, tokens and
seeded samples must equal the co-located engine's, and no KV block may leak on either side."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.kv_connector import HandoffError, KVHandle

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
           "A somewhat longer prompt, so that its KV spans several blocks of the pool: one two three."]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    ckpt = make_checkpoint(tmp / "ckpt", arch="llama")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=128,
                                      max_seq_len=128, kv_block_size=4, kv_cache_memory="512KiB"),
                          progress=False)
    return out


@pytest.fixture
def phases(engine_dir):
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", handoff_timeout_s=30))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation"))
    yield ctx, gen
    ctx.close()


def run_disaggregated(ctx: LLMEngine, gen: LLMEngine, prompts, params) -> dict[int, list]:
    """Every prompt through context then generation; each request's outputs in order (the
    context's first-token output first), keyed by prompt index."""
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    ids = {ctx.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
    gen_ids: dict[str, int] = {}
    while ctx.has_unfinished() or gen.has_unfinished():
        for out in ctx.step():
            i = ids[out.request_id]
            outs[i].append(out)
            if out.kv_handle is not None:
                # The handle crosses a process boundary as JSON in the real server.
                handle = KVHandle.from_json(out.kv_handle.to_json())
                gen_ids[gen.add_handoff(handle, params[i])] = i
        for out in gen.step():
            outs[gen_ids[out.request_id]].append(out)
    return outs


def _text(outs) -> str:
    return "".join(o.text_delta for o in outs)


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("sampling", [
    dict(max_tokens=12, ignore_eos=True),
    dict(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=1234),
    dict(max_tokens=9, ignore_eos=True, temperature=1.3, seed=7, repetition_penalty=1.2, logprobs=1),
    # structured output: the generation side's matcher resumes after the context side's first token
    dict(max_tokens=40, temperature=1.0, seed=3, guided_decoding_guide_type="json_schema",
         guided_decoding_guide='{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, '
                               '"maximum": 99}, "w": {"enum": ["ab", "cd"]}}, "required": ["n", "w"]}'),
], ids=["greedy", "seeded", "seeded-penalties-logprobs", "json-schema"])
def test_disaggregated_equals_colocated(engine_dir, phases, sampling):
    ctx, gen = phases
    params = [SamplingParams(**sampling) for _ in PROMPTS]
    colocated = LLMEngine.from_engine_dir(engine_dir).generate(PROMPTS, params)
    outs = run_disaggregated(ctx, gen, PROMPTS, params)
    for i, ref in enumerate(colocated):
        got = outs[i]
        assert got[0].finish_reason == "handoff" and got[-1].finished
        assert _tokens(got) == ref.output_token_ids
        assert _text(got) == ref.text
        assert got[-1].text == ref.text  # the generation side's running text includes the first token
        assert got[-1].finish_reason == ref.finish_reason
        if ref.cum_logprob is not None:
            assert got[-1].cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-4)
    for engine in (ctx, gen):
        engine.poll()
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.kv_handoff_blocks_held == 0
    assert ctx.stats().kv_handoffs_total == len(PROMPTS) == gen.stats().kv_handoffs_total
    assert gen.stats().kv_handoff_bytes_total == ctx.stats().kv_handoff_bytes_total > 0


def test_one_token_request_finishes_on_the_context_side(phases):
    ctx, _ = phases
    out = ctx.generate([PROMPTS[0]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.kv_handle is None and len(out.output_token_ids) == 1
    assert ctx.stats().kv_handoff_blocks_held == 0


def test_untaken_handoff_is_freed_after_its_deadline(engine_dir):
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", handoff_timeout_s=0.2))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation"))
    try:
        out = ctx.generate([PROMPTS[2]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert out.kv_handle is not None and ctx.stats().kv_handoff_blocks_held == len(out.kv_handle.blocks)
        time.sleep(0.3)
        ctx.poll()
        stats = ctx.stats()
        assert stats.kv_handoff_blocks_held == 0 and stats.kv_handoffs_expired_total == 1
        # A generation side that comes too late gets a clear error, and holds nothing.
        rid = gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=8, ignore_eos=True))
        outs = [o for o in _drain(gen) if o.request_id == rid]
        assert outs[-1].finish_reason == "error" and "expired" in outs[-1].error
        assert gen.stats().kv_blocks_used == 0
    finally:
        ctx.close()


def test_request_aborted_before_import_releases_the_handle_at_once(phases):
    ctx, gen = phases
    out = ctx.generate([PROMPTS[2]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    rid = gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=8, ignore_eos=True))
    gen.abort(rid)  # before any step: never imported
    _drain(gen)
    ctx.poll()
    assert ctx.stats().kv_handoff_blocks_held == 0 and ctx.stats().kv_handoffs_expired_total == 0
    assert gen.stats().kv_blocks_used == 0


def test_bad_handoff_requests_fail_alone(phases):
    ctx, gen = phases
    out = ctx.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with pytest.raises(ValueError, match="max_tokens"):  # already generated one of one
        gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=1))
    ctx.poll()
    assert ctx.stats().kv_handoff_blocks_held == 0  # released on the error
    with pytest.raises(HandoffError, match="malformed"):
        KVHandle.from_json(b"{not json")
    with pytest.raises(ValueError, match="max_seq_len"):  # refused on the context side already
        ctx.add_request(PROMPTS[0], SamplingParams(max_tokens=200))


def test_owner_gone_fails_the_import_clearly(engine_dir):
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context"))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation"))
    out = ctx.generate([PROMPTS[1]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    ctx.close()  # the context model unloaded: its segment is unlinked
    assert not os.path.exists(out.kv_handle.location)
    rid = gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=6, ignore_eos=True))
    outs = [o for o in _drain(gen) if o.request_id == rid]
    assert outs[-1].finish_reason == "error" and "gone" in outs[-1].error
    assert gen.stats().kv_blocks_used == 0


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_network_connector_hands_over_like_shared_memory(engine_dir, tmp_path):
    """The TCP connector (context and generation servers on different hosts; loopback here),
    both sides given the same key file."""
    key = tmp_path / "kv.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    ctx = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", kv_connector="tcp://127.0.0.1:0",
                                                              kv_auth_key_file=str(key)))
    gen = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="generation", kv_peers="127.0.0.1",
                                                              kv_auth_key_file=str(key)))
    try:
        params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3) for _ in PROMPTS]
        colocated = LLMEngine.from_engine_dir(engine_dir).generate(PROMPTS, params)
        outs = run_disaggregated(ctx, gen, PROMPTS, params)
        assert outs[0][0].kv_handle.location.startswith("tcp://127.0.0.1:")
        for i, ref in enumerate(colocated):
            assert _tokens(outs[i]) == ref.output_token_ids and _text(outs[i]) == ref.text
        ctx.poll()
        assert ctx.stats().kv_handoff_blocks_held == 0 and gen.stats().kv_blocks_used == 0
        assert gen.stats().kv_handoffs_total == len(PROMPTS)
        # A handle released unused (the request ended first) is freed at once over the network too.
        out = ctx.generate([PROMPTS[2]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        gen.abort(gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=8, ignore_eos=True)))
        _drain(gen)
        ctx.poll()
        assert ctx.stats().kv_handoff_blocks_held == 0 and ctx.stats().kv_handoffs_expired_total == 0
        # The context server gone: a clear error, nothing held.
        out = ctx.generate([PROMPTS[1]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    finally:
        ctx.close()
    rid = gen.add_handoff(out.kv_handle, SamplingParams(max_tokens=6, ignore_eos=True))
    failed = [o for o in _drain(gen) if o.request_id == rid][-1]
    assert failed.finish_reason == "error" and "gone away" in failed.error
    assert gen.stats().kv_blocks_used == 0
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(phase="context", kv_connector="udp://x"))


def test_int8_kv_cache_is_handed_over_with_its_scales(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp_path / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=128, max_seq_len=128,
                                      kv_block_size=4, kv_cache_memory="256KiB", kv_cache_dtype="int8"),
                          progress=False)
    ctx = LLMEngine.from_engine_dir(out, RuntimeConfig(phase="context"))
    gen = LLMEngine.from_engine_dir(out, RuntimeConfig(phase="generation"))
    try:
        assert ctx.executor.kv_scales is not None  # the scales pools travel with the int8 pools
        params = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in PROMPTS]
        colocated = LLMEngine.from_engine_dir(out).generate(PROMPTS, params)
        outs = run_disaggregated(ctx, gen, PROMPTS, params)
        assert [_tokens(outs[i]) for i in range(len(PROMPTS))] == [r.output_token_ids for r in colocated]
    finally:
        ctx.close()
