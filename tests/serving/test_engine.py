"""The engine API on a tiny real engine: abort, finish reasons, stop strings, streaming, timestamps,
bad requests and logprobs (checked against Hugging Face transformers on the same checkpoint)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from click.testing import CliRunner

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.cli.main import main
from trtforge.config.sampling import SamplingParams
from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.core import kv_cache_manager
from trtforge.serving.core.scheduler import EngineOverloaded
from trtforge.serving.engine import LLMEngine
from trtforge.serving.outputs import RequestOutput

MAX_SEQ_LEN = 64
PROMPT = "The quick brown fox jumps over the lazy dog."


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-api")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64,
                                      max_seq_len=MAX_SEQ_LEN, kv_block_size=4, kv_cache_memory="256KiB"),
                          progress=False)
    return ckpt, out


@pytest.fixture
def engine(dirs) -> LLMEngine:
    return LLMEngine.from_engine_dir(dirs[1])


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output of every request, in order."""
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_abort_frees_blocks_and_reports_abort(engine):
    keep = engine.add_request(PROMPT, greedy(20))
    running = engine.add_request("Hello, world!", greedy(40))
    for _ in range(3):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    assert engine.abort(running) is True
    assert engine.abort(running) is False, "aborting twice must say there is nothing to abort"
    assert engine.abort("no-such-request") is False
    outs = run_all(engine)
    final = outs[running][-1]
    assert final.finished and final.finish_reason == "abort" and final.new_token_ids == []
    assert len(final.output_token_ids) >= 1, "the aborted request had generated tokens before"
    assert outs[keep][-1].finish_reason == "length"
    assert len(outs[keep][-1].output_token_ids) == 20
    assert engine.stats().kv_blocks_used == 0


def test_abort_of_waiting_and_running_requests_leaves_no_blocks(dirs):
    engine = LLMEngine.from_engine_dir(dirs[1], max_batch_size=1)
    first = engine.add_request(PROMPT, greedy(30))
    waiting = engine.add_request("Hello again", greedy(30))
    engine.step()
    assert engine.stats().num_waiting == 1 and engine.stats().kv_blocks_used > 0
    assert engine.abort(waiting) and engine.abort(first)
    assert engine.stats().kv_blocks_used == 0, "abort must free the KV blocks at once"
    finals = {o.request_id: o for o in engine.step()}
    assert {finals[first].finish_reason, finals[waiting].finish_reason} == {"abort"}
    assert not engine.has_unfinished()
    engine.scheduler.kv_manager.check_invariants()


def test_stats_report_prefix_cache_hits_of_a_repeated_prompt(engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    block = engine.scheduler_config.block_size
    assert len(ids) > 2 * block, "the prompt must fill blocks for the cache to hold any"
    (first,) = engine.generate([ids], greedy(3))
    stats = engine.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (len(ids), 0)
    (again,) = engine.generate([ids], greedy(3))
    stats = engine.stats()
    hits = (len(ids) - 1) // block * block  # every full block but the last token's is reused
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (2 * len(ids), hits)
    assert stats.prefix_cache_hit_rate == pytest.approx(hits / (2 * len(ids)))
    assert again.output_token_ids == first.output_token_ids


def test_cache_salt_shares_prefix_hits_only_within_a_salt(engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    block = engine.scheduler_config.block_size
    full = (len(ids) - 1) // block * block  # what a repeated prompt reuses

    def hits(salt):
        before = engine.stats().prefix_cache_hit_tokens
        (out,) = engine.generate([ids], greedy(3, cache_salt=salt))
        assert out.error is None
        return engine.stats().prefix_cache_hit_tokens - before, out.output_token_ids

    first, tokens = hits("tenant-a")
    assert first == 0
    assert hits("tenant-b") == (0, tokens)  # another salt: computed again, same tokens
    assert hits(None) == (0, tokens)  # unsalted requests have their own namespace
    assert hits("tenant-a") == (full, tokens)
    assert hits("tenant-b") == (full, tokens)
    assert hits(None) == (full, tokens)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(ids, greedy(3, cache_salt="s" * 513))


def test_colliding_prefix_key_recomputes_instead_of_reusing_another_prompts_kv(dirs, monkeypatch):
    victim, other = PROMPT, "Pack my box with five dozen liquor jugs, said the quick judge."
    plain = LLMEngine.from_engine_dir(dirs[1], enable_prefix_caching=False)
    expected = [o.output_token_ids for o in plain.generate([victim, other], greedy(6))]
    # Every block gets the same key: a lookup without the token check would serve `other`
    # the victim's first block.
    monkeypatch.setattr(kv_cache_manager, "block_key", lambda parent, packed: b"\0" * 32)
    engine = LLMEngine.from_engine_dir(dirs[1])
    assert engine.tokenizer.encode(other, add_special_tokens=False)[:4] \
        != engine.tokenizer.encode(victim, add_special_tokens=False)[:4]
    (first,) = engine.generate([victim], greedy(6))
    assert engine.scheduler.kv_manager.num_cached_blocks == 1
    (second,) = engine.generate([other], greedy(6))
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 0 and stats.prefix_cache_queried_tokens > 0
    assert [first.output_token_ids, second.output_token_ids] == expected


def test_full_queue_refuses_at_once_and_admitted_requests_finish(dirs, engine):
    alone = {p: o.output_token_ids for p, o in zip([PROMPT, "Hello, world!"],
                                                     engine.generate([PROMPT, "Hello, world!"], greedy(8)))}
    busy = LLMEngine.from_engine_dir(dirs[1], max_batch_size=1, max_queue_size=1)
    first = busy.add_request(PROMPT, greedy(8))
    started = time.monotonic()
    with pytest.raises(EngineOverloaded, match=r"server busy, retry later.*max_queue_size=1"):
        busy.add_request("Hello, world!", greedy(8), request_id="refused")
    assert time.monotonic() - started < 1.0
    busy.step()  # the first is admitted: the queue has room again
    second = busy.add_request("Hello, world!", greedy(8), request_id="refused")  # id reusable
    outs = run_all(busy)
    assert outs[first][-1].output_token_ids == alone[PROMPT]
    assert outs[second][-1].output_token_ids == alone["Hello, world!"]
    stats = busy.stats()
    assert stats.requests_refused_total == 1 and stats.kv_blocks_used == 0


def test_generate_queues_more_prompts_than_the_waiting_queue_holds(dirs, engine):
    prompts = [PROMPT, "Hello, world!", "a b c", PROMPT, "Hello, world!"]
    want = [o.output_token_ids for o in engine.generate(prompts, greedy(6))]
    small = LLMEngine.from_engine_dir(dirs[1], max_batch_size=1, max_queue_size=2)
    outs = small.generate(prompts, greedy(6))  # 5 prompts through a queue of 2: they wait their turn
    assert [o.output_token_ids for o in outs] == want
    assert small.stats().requests_refused_total > 0 and small.stats().kv_blocks_used == 0
    with pytest.raises(ValueError, match="empty"):  # a bad prompt late in the list withdraws the call
        small.generate(prompts + [""], greedy(6))
    assert not small.has_unfinished() and small.stats().kv_blocks_used == 0


def test_request_past_its_deadline_is_aborted_waiting_or_running(dirs, engine):
    (alone,) = engine.generate(["Hello, world!"], greedy(40))
    busy = LLMEngine.from_engine_dir(dirs[1], max_batch_size=2)
    running = busy.add_request(PROMPT, greedy(40, timeout_s=1.0))
    keep = busy.add_request("Hello, world!", greedy(40))
    waiting = busy.add_request("Hi there", greedy(40, timeout_s=1.0))
    started = time.monotonic()
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(3):
        for out in busy.step():
            outs.setdefault(out.request_id, []).append(out)
    assert time.monotonic() - started < 0.9, "too slow to observe the requests before the deadline"
    assert busy.stats().num_running == 2 and busy.stats().num_waiting == 1
    time.sleep(max(0.0, started + 1.05 - time.monotonic()))
    for rid, more in run_all(busy).items():
        outs.setdefault(rid, []).extend(more)
    for rid in (running, waiting):
        final = outs[rid][-1]
        assert final.finished and final.finish_reason == "timeout"
        assert "deadline exceeded: timeout_s=1" in final.error
    assert 3 <= len(outs[running][-1].output_token_ids) < 40
    assert outs[waiting][-1].output_token_ids == [] and outs[waiting][-1].metrics.first_scheduled_time is None
    assert outs[keep][-1].output_token_ids == alone.output_token_ids
    stats = busy.stats()
    assert stats.requests_timed_out_total == 2 and stats.kv_blocks_used == 0
    busy.scheduler.kv_manager.check_invariants()


def test_cli_refuses_too_many_tokens_reports_timeouts_and_waits_for_queue_room(dirs):
    engine_dir = str(dirs[1])
    result = CliRunner().invoke(main, ["generate", engine_dir, "--prompt", PROMPT,
                                       "--max-tokens", "99999999999999"])
    assert result.exit_code != 0 and "exceeds max_seq_len=64" in result.output
    result = CliRunner().invoke(main, ["generate", engine_dir, "--prompt", PROMPT,
                                       "--max-tokens", "8", "--timeout-s", "0.000001", "--json"])
    assert result.exit_code == 0, result.output
    assert '"finish_reason": "timeout"' in result.output
    # An offline run waits for room in a bounded queue instead of being refused (a server refuses:
    # test_full_queue_refuses_at_once_and_admitted_requests_finish).
    result = CliRunner().invoke(main, ["generate", engine_dir, "--prompt", "a", "--prompt", "b",
                                       "--max-tokens", "4", "--schedule", "max_queue_size=1", "--json"])
    assert result.exit_code == 0, result.output
    assert result.output.count('"finish_reason": "length"') == 2


def test_finish_reasons_stop_token_and_length(engine):
    (full,) = engine.generate([PROMPT], greedy(12))
    assert full.finish_reason == "length" and len(full.output_token_ids) == 12
    stop_token = full.output_token_ids[5]
    first = full.output_token_ids.index(stop_token)
    (stopped,) = engine.generate([PROMPT], greedy(12, stop_token_ids=[stop_token]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    assert stopped.output_token_ids == full.output_token_ids[:first + 1]


def _stop_string_of(text: str) -> str:
    """A 2-character piece of the text, not at its start (a stop string known to occur)."""
    for i in range(max(len(text) // 3, 1), len(text) - 1):
        piece = text[i:i + 2]
        if piece.isprintable() and "\ufffd" not in piece and piece.strip() == piece:
            return piece
    pytest.fail(f"no clean 2-character piece in the generated text {text!r} to use as a stop string")


def test_stop_string_is_cut_and_not_returned(engine):
    (full,) = engine.generate([PROMPT], greedy(24))
    stop = _stop_string_of(full.text)
    deltas = list(engine.stream(PROMPT, greedy(24, stop=[stop])))
    final = deltas[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[:full.text.index(stop)]
    assert stop not in "".join(d.text_delta for d in deltas)


def test_streaming_deltas_concatenate_to_final_text(engine):
    outs = list(engine.stream(PROMPT, greedy(24)))
    final = outs[-1]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert "".join(o.text_delta for o in outs) == final.text
    assert [t for o in outs for t in o.new_token_ids] == final.output_token_ids
    assert final.text == engine.tokenizer.decode(final.output_token_ids, skip_special_tokens=True)


def test_timestamps_are_ordered(engine):
    rids = [engine.add_request(PROMPT, greedy(8)), engine.add_request("Hello, world!", greedy(5))]
    finals = {rid: outs[-1] for rid, outs in run_all(engine).items()}
    for rid in rids:
        m = finals[rid].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time == m.token_times[0]
        assert m.token_times == sorted(m.token_times) and len(m.token_times) == len(finals[rid].output_token_ids)
        assert m.token_times[-1] <= m.finished_time
        assert m.ttft > 0 and m.tpot is not None and m.tpot >= 0


@pytest.mark.parametrize("prompt, params, words", [
    (list(range(5, 5 + MAX_SEQ_LEN)), greedy(4), ["too long", str(MAX_SEQ_LEN)]),
    (PROMPT, SamplingParams(max_tokens=0), ["max_tokens", "0"]),
    (PROMPT, SamplingParams(temperature=-1.0), ["temperature", "-1.0"]),
    (PROMPT, SamplingParams(top_p=1.5), ["top_p", "1.5"]),
    (PROMPT, SamplingParams(stop="###"), ["stop", "###"]),  # a bare string, not a list
    ([5, 6, 10**6], greedy(4), ["outside the vocabulary", "1000000"]),
    (PROMPT, greedy(99999999999999), ["max_tokens=99999999999999 exceeds max_seq_len=64",
                                      "max_tokens <= "]),
    (PROMPT, greedy(4, timeout_s=0.0), ["timeout_s=0.0", "> 0"]),
    ("", greedy(4), ["empty"]),
    # Hostile sampling values: refused at admission, naming the field and the value.
    (PROMPT, greedy(4, stop_token_ids=[10**9], min_tokens=2),
     ["SamplingParams.stop_token_ids contains 1000000000", "vocabulary"]),
    (PROMPT, greedy(4, bad_words_ids=[[5, 10**6]]), ["bad_words_ids contains [5, 1000000]", "vocabulary"]),
    (PROMPT, greedy(4, stop=[f"s{i}" for i in range(5000)]), ["SamplingParams.stop=", "at most 64"]),
    (PROMPT, greedy(4, stop=["x" * (1 << 20)]), ["SamplingParams.stop=", "at most 1024 characters"]),
    (PROMPT, greedy(4, temperature=float("nan")), ["SamplingParams.temperature=nan"]),
    (PROMPT, greedy(4, temperature=float("inf")), ["SamplingParams.temperature=inf"]),
    (PROMPT, greedy(4, repetition_penalty=0.0), ["SamplingParams.repetition_penalty=0.0"]),
    (PROMPT, greedy(4, logprobs=10**6), ["SamplingParams.logprobs=1000000", "1..20"]),
    (PROMPT, greedy(4, bad_words=["w"] * 1000), ["SamplingParams.bad_words=", "at most 256"]),
])
def test_bad_request_raises_and_engine_keeps_serving(engine, prompt, params, words):
    (alone,) = engine.generate([PROMPT], greedy(10))
    other = engine.add_request(PROMPT, greedy(10))
    engine.step()  # `other` is running when the bad request arrives
    with pytest.raises(ValueError) as err:
        engine.add_request(prompt, params)
    for word in words:
        assert word in str(err.value), f"{word!r} missing from the message: {err.value}"
    outs = run_all(engine)
    assert list(outs) == [other], "the rejected request must leave no trace in the engine"
    assert outs[other][-1].output_token_ids == alone.output_token_ids
    assert engine.stats().kv_blocks_used == 0 and engine.stats().num_waiting == 0


def test_longest_prompt_may_ask_one_token_and_duplicate_ids_are_refused(engine):
    longest = list(range(5, 4 + MAX_SEQ_LEN))
    with pytest.raises(ValueError, match="send max_tokens <= 1 for this prompt"):
        engine.add_request(longest, greedy(16), request_id="long")
    rid = engine.add_request(longest, greedy(1), request_id="long")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, greedy(4), request_id="long")
    final = run_all(engine)[rid][-1]
    assert final.finish_reason == "length" and len(final.output_token_ids) == 1


def test_logprobs_match_transformers(dirs, engine):
    from transformers import AutoModelForCausalLM

    outs = list(engine.stream(PROMPT, greedy(10, logprobs=3)))
    tokens = outs[-1].output_token_ids
    logprobs = [lp for o in outs for lp in o.logprobs]
    tops = [t for o in outs for t in o.top_logprobs]
    assert len(logprobs) == len(tops) == len(tokens) == 10
    assert all(len(top) == 3 and top[0][0] == tok and top[0][1] == lp  # greedy: chosen = most likely
               for top, tok, lp in zip(tops, tokens, logprobs))
    assert outs[-1].cum_logprob == pytest.approx(sum(logprobs), abs=1e-4)

    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(str(dirs[0]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)

    (blocking,) = engine.generate([PROMPT], greedy(10, logprobs=3))
    assert blocking.output_token_ids == tokens
    # Every token's, not the last. Not bit-identical: this run finds the prompt in the prefix cache,
    # so its tokens go through products of other row counts (C GEMV vs oneDNN, another summation
    # order) — the same ~1e-7 float32 rounding differences vLLM has across batch shapes.
    assert blocking.logprobs == pytest.approx(logprobs, abs=1e-5)
    assert [[t for t, _ in top] for top in blocking.top_logprobs] == [[t for t, _ in top] for top in tops]
    torch.testing.assert_close(torch.tensor([[lp for _, lp in top] for top in blocking.top_logprobs]),
                               torch.tensor([[lp for _, lp in top] for top in tops]), atol=1e-5, rtol=0)

    (plain,) = engine.generate([PROMPT], greedy(3))
    assert plain.logprobs is None and plain.cum_logprob is None


def test_top_logprobs_equal_transformers_log_softmax_top_k(dirs, engine):
    """SamplingParams.logprobs=K: each token's K alternatives are HF's log_softmax top-k of the same
    checkpoint (the raw model distribution: not changed by temperature or penalties)."""
    from transformers import AutoModelForCausalLM

    k = 20
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=3,
                                                      presence_penalty=0.5, logprobs=k))
    tokens = out.output_token_ids
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(str(dirs[0]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    values, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    assert len(out.top_logprobs) == len(tokens) == 8 and all(len(top) == k for top in out.top_logprobs)
    got_values = torch.tensor([[lp for _, lp in top] for top in out.top_logprobs])
    torch.testing.assert_close(got_values, values, atol=1e-4, rtol=0)
    for top, want_ids, want_values in zip(out.top_logprobs, ids.tolist(), values.tolist()):
        for j, (token_id, _) in enumerate(top):  # the same ids, but where two values tie within tolerance
            assert token_id == want_ids[j] or any(abs(want_values[j] - want_values[i]) < 1e-4
                                                  for i in range(k) if want_ids[i] == token_id)
    chosen = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=1e-4, rtol=0)


def test_num_cached_tokens_counts_the_prompt_served_from_the_prefix_cache(dirs):
    engine = LLMEngine.from_engine_dir(dirs[1])
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    (first,) = engine.generate([PROMPT], greedy(3))
    (again,) = engine.generate([PROMPT], greedy(3))
    block = engine.scheduler_config.block_size
    assert first.num_cached_tokens == 0
    # Full blocks of the prompt, the last prompt token always computed.
    assert again.num_cached_tokens == (len(prompt_ids) - 1) // block * block > 0
    assert again.output_token_ids == first.output_token_ids
    streamed = list(engine.stream(PROMPT, greedy(3)))
    assert streamed[-1].finished and streamed[-1].num_cached_tokens == again.num_cached_tokens
    (other,) = engine.generate([PROMPT], greedy(3, cache_salt="another-tenant"))
    assert other.num_cached_tokens == 0
    off = LLMEngine.from_engine_dir(dirs[1], enable_prefix_caching=False)
    assert [o.num_cached_tokens for o in off.generate([PROMPT, PROMPT], greedy(2))] == [0, 0]


GOOD = [(PROMPT, greedy(10)),
        ("Hello, world!", SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)),
        ("Hi there", greedy(10, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2))]


def _good_alone(dirs) -> list[list[int]]:
    """The good requests' tokens in a run without any hostile request."""
    engine = LLMEngine.from_engine_dir(dirs[1])
    rids = [engine.add_request(p, dataclasses.replace(sp)) for p, sp in GOOD]
    outs = run_all(engine)
    return [outs[r][-1].output_token_ids for r in rids]


def test_hostile_requests_in_the_batch_fail_alone(dirs):
    """Requests whose sampling values the batched sampler cannot take share batches with good ones:
    each fails alone with a clear error, the good ones get exactly their tokens of a run without
    them, and no KV block stays held."""
    expected = _good_alone(dirs)
    engine = LLMEngine.from_engine_dir(dirs[1])
    vocab = engine.engine_config.model.vocab_size
    good = [engine.add_request(p, dataclasses.replace(sp)) for p, sp in GOOD]
    # Past admission, changed behind the engine's back (what validation cannot see)...
    end_id, nan_temp = greedy(10, min_tokens=3), SamplingParams(max_tokens=10, temperature=0.7)
    hostile = {engine.add_request("Hello hostile", end_id): "stop_token_ids contains 1000000000",
               engine.add_request("Hi hostile", nan_temp): "SamplingParams.temperature=nan is invalid"}
    end_id.stop_token_ids.append(10**9)
    nan_temp.temperature = float("nan")
    # ... and valid values whose masks leave nothing to sample.
    everything = greedy(10, min_tokens=1, stop_token_ids=list(range(vocab)))
    hostile[engine.add_request("The quick", everything)] = "no token can be sampled"
    outs: dict[str, list[RequestOutput]] = {}
    for out in engine.step():
        outs.setdefault(out.request_id, []).append(out)
    with pytest.raises(ValueError, match="stop_token_ids contains 1000000000"):  # refused outright
        engine.add_request(PROMPT, greedy(10, stop_token_ids=[10**9], min_tokens=1))
    for rid, more in run_all(engine).items():
        outs.setdefault(rid, []).extend(more)
    for rid, why in hostile.items():
        final = outs[rid][-1]
        assert final.finished and final.finish_reason == "error" and why in final.error, final.error
        assert final.error.startswith(f"request {rid} failed: ")
    assert [outs[r][-1].output_token_ids for r in good] == expected
    assert all(outs[r][-1].finish_reason == "length" for r in good)
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    engine.scheduler.kv_manager.check_invariants()


def test_a_request_failing_after_sampling_fails_alone(dirs):
    expected = _good_alone(dirs)
    engine = LLMEngine.from_engine_dir(dirs[1])
    good = [engine.add_request(p, dataclasses.replace(sp)) for p, sp in GOOD]
    victim = engine.add_request("Hello hostile", greedy(10))
    engine.step()

    def broken(ids):
        raise RuntimeError("cannot decode")

    engine._requests[victim].detok.step = broken
    outs = run_all(engine)
    final = outs[victim][-1]
    assert final.finish_reason == "error" and "RuntimeError: cannot decode" in final.error
    assert [outs[r][-1].output_token_ids for r in good] == expected
    assert engine.stats().kv_blocks_used == 0


def test_waiting_queue_is_bounded_by_default(dirs, engine):
    assert "max_queue_size" not in engine.engine_config.scheduling  # engine.json leaves it to the default
    cfg = engine.scheduler_config
    assert (cfg.max_queue_size, cfg.max_queued_tokens) == (4096, 4_194_304)
    assert (SchedulerConfig.max_queue_size, SchedulerConfig.max_queued_tokens) == (4096, 4_194_304)
    long = SchedulerConfig.for_engine({"max_seq_len": 8_000_000, "kv_block_size": 16}, {})
    assert long.max_queued_tokens == 7_999_999  # the default admits the longest prompt
    assert SchedulerConfig.for_engine({"max_seq_len": 64, "kv_block_size": 4}, {"max_queued_tokens": 0},
                                      ).max_queued_tokens == 0  # 0 (unbounded) stays available
