"""Greedy speculative decoding is token for token what one-token decoding gives, on every family's
parity checkpoint against Hugging Face transformers; stop strings, stop tokens and max_tokens
inside accepted drafts end the request where one-token decoding would; logprobs and penalties
are the target's at each committed position; KV blocks are all freed (aborts mid-verification
included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.checkpoints import VARIANTS, make_variant
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import Phase, RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.engine import LLMEngine, check_speculation
from trtforge.serving.spec_decode.controller import SpecDecodeController
from trtforge.serving.spec_decode.proposer import ProposalRequest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MAX_NEW = 32
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                          disable_by_batch_size=None, backoff_after_rejections=0)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat a random segment (so prompt lookup proposes), across block boundaries."""
    g = torch.Generator().manual_seed(3)
    out = []
    for seg, reps in ((3, 3), (7, 3), (12, 2), (20, 2)):
        part = torch.randint(5, min(vocab, 500), (seg,), generator=g).tolist()
        out.append(part * reps + part[:2])
    return out


def build(tmp, ckpt) -> str:
    out, _ = build_engine(str(ckpt), tmp / "engine", BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=256,
                                                                 kv_cache_memory="16MiB", kv_block_size=4),
                          progress=False)
    return out


def hf_greedy(ckpt, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            refs.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                    pad_token_id=hf.config.pad_token_id)[0, len(p):].tolist())
    return refs


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ngram_greedy_equals_transformers(tmp_path, name):
    ckpt = make_variant(tmp_path / "ckpt", name)
    engine = LLMEngine.from_engine_dir(build(tmp_path, ckpt), RuntimeConfig(speculative_config=NGRAM))
    prompts = repetitive_prompts(engine.engine_config.model.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    for p, out, ref in zip(prompts, outs, hf_greedy(ckpt, prompts, MAX_NEW)):
        assert out.output_token_ids == ref, f"{name}: greedy tokens differ for a {len(p)}-token prompt"
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0, "the prompts must make prompt lookup propose"
    assert stats.kv_blocks_used == 0
    engine.scheduler.kv_manager.check_invariants()


class ReferenceProposer:
    """Drafts from a known continuation (what a perfect draft model would say), with every
    `wrong_every`-th proposal's third draft corrupted: long accepts and partial rejects both."""

    def __init__(self, continuations: dict[str, list[int]], wrong_every: int = 3):
        self.continuations, self.wrong_every, self.calls = continuations, wrong_every, 0

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            full, n = self.continuations[r.request_id], len(r.prompt_token_ids) + len(r.output_token_ids)
            drafts = list(full[n:n + r.max_drafts])
            self.calls += 1
            if self.calls % self.wrong_every == 0 and len(drafts) >= 3:
                drafts[2] = (drafts[2] + 1) % 500
            out.append(drafts)
        return out

    def forget(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec-qwen")
    ckpt = make_variant(tmp / "ckpt", "qwen2-gqa-bias-tied")
    return ckpt, build(tmp, ckpt)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """Every output of every request (streaming order), keyed by request id r0, r1, ..."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=f"r{i}")
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def with_reference(engine_dir: str, prompts, plain_outs, k: int = 4) -> LLMEngine:
    cfg = dataclasses.replace(NGRAM, num_speculative_tokens=k)
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(speculative_config=cfg))
    conts = {f"r{i}": p + outs[-1].output_token_ids for i, (p, outs) in enumerate(zip(prompts, plain_outs))}
    engine.spec = SpecDecodeController(cfg, ReferenceProposer(conts))
    return engine


def same(a, b) -> None:
    """Equal final outputs and equal streams (the concatenated new tokens and text deltas)."""
    for x, y in zip(a, b):
        fx, fy = x[-1], y[-1]
        assert (fx.output_token_ids, fx.text, fx.finish_reason, fx.stop_reason) == \
               (fy.output_token_ids, fy.text, fy.finish_reason, fy.stop_reason)
        assert [t for o in x for t in o.new_token_ids] == [t for o in y for t in o.new_token_ids]
        assert "".join(o.text_delta for o in x) == fx.text


def test_reference_drafts_are_accepted_and_the_output_is_unchanged(qwen):
    ckpt, path = qwen
    prompts = repetitive_prompts(600)
    plain = run(LLMEngine.from_engine_dir(path), prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    spec = with_reference(path, prompts, plain)
    outs = run(spec, prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    same(plain, outs)
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens // 2
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, "some were corrupted"
    final = [o[-1] for o in outs]
    assert sum(f.num_accepted_tokens for f in final) == stats.spec_decode_num_accepted_tokens
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("where", ["stop_string", "stop_token", "max_tokens"])
def test_a_stop_inside_accepted_drafts_ends_the_request_there(qwen, where):
    _, path = qwen
    prompts = repetitive_prompts(600)
    base = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    free = run(LLMEngine.from_engine_dir(path), prompts, base)
    params = []
    for outs in free:
        ids = outs[-1].output_token_ids
        if where == "stop_string":
            text = outs[-1].text
            params.append(dataclasses.replace(base, stop=[text[len(text) // 3:len(text) // 3 + 3]]))
        elif where == "stop_token":
            params.append(dataclasses.replace(base, ignore_eos=False, stop_token_ids=[ids[9]]))
        else:
            params.append(dataclasses.replace(base, max_tokens=11))
    plain = run(LLMEngine.from_engine_dir(path), prompts, params)
    spec = with_reference(path, prompts, free, k=6)
    outs = run(spec, prompts, params)
    same(plain, outs)
    assert spec.stats().spec_decode_num_accepted_tokens > 0
    assert spec.stats().kv_blocks_used == 0


def test_logprobs_and_penalties_are_the_targets_at_each_position(qwen):
    _, path = qwen
    prompts = repetitive_prompts(600)
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=MAX_NEW, repetition_penalty=1.4, presence_penalty=0.3,
                             frequency_penalty=0.2, logprobs=0),
              SamplingParams(max_tokens=MAX_NEW, min_tokens=20, bad_words_ids=[[7], [11, 12]]),
              SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)]
    plain = run(LLMEngine.from_engine_dir(path), prompts, params)
    for engine in (LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=NGRAM)),
                   with_reference(path, prompts, plain)):
        outs = run(engine, prompts, params)
        same(plain, outs)
        for x, y in zip(plain, outs):
            lx = [lp for o in x for lp in (o.logprobs or [])]
            ly = [lp for o in y for lp in (o.logprobs or [])]
            assert len(lx) == len(ly)
            torch.testing.assert_close(torch.tensor(ly), torch.tensor(lx), atol=1e-4, rtol=0)
            tx = [[t for t, _ in top] for o in x for top in (o.top_logprobs or [])]
            ty = [[t for t, _ in top] for o in y for top in (o.top_logprobs or [])]
            assert tx == ty
        assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_opt_out_abort_mid_verification_and_no_leaks(qwen):
    _, path = qwen
    engine = LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=NGRAM))
    prompts = repetitive_prompts(600)
    keep = engine.add_request(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True, speculative=False))
    victims = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts[1:]]
    while engine.stats().spec_decode_num_drafts == 0:
        engine.step()
    for rid in victims:
        assert engine.abort(rid)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[keep].num_draft_tokens == 0 and len(outs[keep].output_token_ids) == 40
    assert all(outs[r].finish_reason == "abort" for r in victims)
    assert engine.stats().kv_blocks_used == 0
    engine.scheduler.kv_manager.check_invariants()


def test_unsupported_combinations_are_refused_by_name(qwen):
    _, path = qwen
    engine = LLMEngine.from_engine_dir(path)
    spec = RuntimeConfig(speculative_config=NGRAM)
    cfg = engine.engine_config
    with pytest.raises(ValueError, match="tensor-parallel"):
        check_speculation(dataclasses.replace(cfg, tp_size=2), spec)
    with pytest.raises(ValueError, match="tensorrt backend"):
        check_speculation(dataclasses.replace(cfg, backend="tensorrt"), spec)
    with pytest.raises(ValueError, match="context phase"):
        check_speculation(cfg, RuntimeConfig(speculative_config=NGRAM, phase=Phase.CONTEXT))
    check_speculation(cfg, spec)
