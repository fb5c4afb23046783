"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny real engine, against Hugging Face
transformers' log_softmax over the same prompt: chunked prefill, a batch mixing such a request with
plain ones, the prefix cache, the refusals."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.prompt_logprobs import score

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."
OTHERS = ["Hello there, my friend", "A tiny engine"]
ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompt-logprobs")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64, max_seq_len=96,
                                      kv_block_size=4, kv_cache_memory="512KiB"),
                          progress=False)
    return ckpt, out


@pytest.fixture(scope="module")
def hf_log_softmax(dirs):
    """log_softmax of HF's logits over a prompt, [len(ids), V] (row p scores token p + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(dirs[0]), dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return run


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_matches_hf(entries, ids: list[int], lp: torch.Tensor, k: int) -> None:
    """Every prompt token after the first: its logprob, rank and top-k equal HF's (ties within ATOL
    may come in either order)."""
    assert [e.token_id for e in entries] == ids[1:]
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), chosen, atol=ATOL, rtol=0)
    for p, e in enumerate(entries):
        row, c = lp[p], float(chosen[p])
        assert int((row > c + ATOL).sum()) + 1 <= e.rank <= int((row > c - ATOL).sum()) + 1
        assert len(e.top) == k
        if k:
            values, top_ids = row.topk(k)
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), values, atol=ATOL, rtol=0)
            for j, (token_id, _) in enumerate(e.top):
                assert token_id == int(top_ids[j]) or abs(float(row[token_id]) - float(values[j])) < ATOL


@pytest.mark.parametrize("chunk", [0, 4, 5])
def test_prompt_logprobs_equal_transformers_log_softmax(dirs, hf_log_softmax, chunk):
    """Whole prompt in one chunk, or split in chunks of 4 / 5 tokens (positions arrive chunk by chunk)."""
    engine = LLMEngine.from_engine_dir(dirs[1], **({"prefill_chunk_size": chunk} if chunk else {}))
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) > 10
    outs = list(engine.stream(PROMPT, greedy(3, prompt_logprobs=5)))
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert len(outs[0].prompt_logprobs) == len(ids) - 1
    assert_matches_hf(outs[0].prompt_logprobs, ids, hf_log_softmax(ids), 5)
    assert outs[-1].num_cached_tokens == 0


def test_generate_returns_them_on_the_final_output_and_k_zero_has_no_alternatives(dirs, hf_log_softmax):
    engine = LLMEngine.from_engine_dir(dirs[1], prefill_chunk_size=4)
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    (out,) = engine.generate([PROMPT], greedy(4, prompt_logprobs=0))
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(ids), 0)
    (plain,) = engine.generate([PROMPT], greedy(4))
    assert plain.prompt_logprobs is None and plain.output_token_ids == out.output_token_ids


def test_a_batch_mixing_them_with_plain_requests_keeps_the_plain_outputs(dirs, hf_log_softmax):
    engine = LLMEngine.from_engine_dir(dirs[1], prefill_chunk_size=6)
    alone = engine.generate(OTHERS, greedy(6, logprobs=2))
    fresh = LLMEngine.from_engine_dir(dirs[1], prefill_chunk_size=6)
    mixed = fresh.generate([OTHERS[0], PROMPT, OTHERS[1]],
                           [greedy(6, logprobs=2), greedy(6, prompt_logprobs=20), greedy(6, logprobs=2)])
    for a, m in zip(alone, [mixed[0], mixed[2]]):
        assert m.output_token_ids == a.output_token_ids and m.text == a.text
        assert m.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert m.prompt_logprobs is None
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert_matches_hf(mixed[1].prompt_logprobs, ids, hf_log_softmax(ids), 20)
    (plain,) = engine.generate([PROMPT], greedy(6))
    assert mixed[1].output_token_ids == plain.output_token_ids


def test_a_cached_prompt_is_computed_again_and_the_cache_still_serves_others(dirs, hf_log_softmax):
    engine = LLMEngine.from_engine_dir(dirs[1])
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    engine.generate([PROMPT], greedy(2))  # the prompt's full blocks are now cached
    (out,) = engine.generate([PROMPT], greedy(2, prompt_logprobs=3))
    assert out.num_cached_tokens == 0  # no position skipped
    assert_matches_hf(out.prompt_logprobs, ids, hf_log_softmax(ids), 3)
    (again,) = engine.generate([PROMPT], greedy(2))
    assert again.num_cached_tokens > 0


def test_out_of_range_k_is_refused_by_name(dirs):
    engine = LLMEngine.from_engine_dir(dirs[1])
    for k in (21, -1, 1.5):
        with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
            engine.add_request(PROMPT, greedy(2, prompt_logprobs=k))


def test_score_ranks_and_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 0.0, 0.0, -1.0]])
    got = score(logits, [2, 0], 2)
    lp = torch.log_softmax(logits, -1)
    assert [e.rank for e in got] == [3, 1]  # two tokens strictly likelier; the likeliest
    assert got[0].logprob == pytest.approx(float(lp[0, 2]))
    assert [t for t, _ in got[1].top] == [0, 1] or [t for t, _ in got[1].top] == [0, 2]
    assert {t for t, _ in got[0].top} == {1, 3}
    assert score(torch.zeros(0, 4), [], 3) == []
