"""The draft_model proposer: greedy output identical with and without it (a target as its own
draft accepts almost everything, a different random draft little), its KV kept in step with the
committed tokens (a long-lived proposer drafts what a fresh one drafts, whatever the target
accepted), every draft KV block freed when requests finish or are aborted, a full draft pool
costing drafts and nothing else, and the refusals of a draft the target cannot use."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.models.engine_dir import read_engine_config
from trtforge.serving.engine import LLMEngine
from trtforge.serving.spec_decode.draft_model import DraftModelProposer, check_draft
from trtforge.serving.spec_decode.proposer import ProposalRequest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LIMITS = dict(dtype="float32", max_batch_size=8, max_num_tokens=64, max_seq_len=128, kv_block_size=4)


def build(tmp, name, ckpt, **limits):
    out, _ = build_engine(str(ckpt), tmp / name, BuildConfig(**{**LIMITS, "kv_cache_memory": "4MiB", **limits}),
                          progress=False)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """target: llama, 2 layers; draft: llama, 1 layer, other weights, the same tokenizer files, a
    prefill budget smaller than the longest prompt (its catch-up is chunked)."""
    tmp = tmp_path_factory.mktemp("draft-model")
    target = build(tmp, "target", make_checkpoint(tmp / "target-ckpt", "llama"))
    draft = build(tmp, "draft", make_checkpoint(tmp / "draft-ckpt", "llama", seed=5, num_hidden_layers=1),
                  max_num_tokens=32)
    return target, draft, tmp


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 70, 9)]


def config(draft, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=4,
                             disable_by_batch_size=None, backoff_after_rejections=0, **extra)


def greedy(engine: LLMEngine, max_tokens: int = 40) -> list[list[int]]:
    outs = engine.generate(prompts(), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def assert_draft_kv_empty(engine: LLMEngine) -> None:
    proposer = engine.spec.proposer
    assert proposer.kv.num_used_blocks == 0 and proposer.num_requests == 0
    proposer.kv.check_invariants()
    assert engine.stats().kv_blocks_used == 0


def test_greedy_output_is_unchanged_and_a_self_draft_is_accepted(engines):
    target, draft, _ = engines
    plain = greedy(LLMEngine.from_engine_dir(target))
    rates = {}
    for name, model in (("self", target), ("other", draft)):
        engine = LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(model)))
        assert greedy(engine) == plain, f"{name} draft: greedy tokens differ from plain decoding"
        stats = engine.stats()
        assert stats.spec_decode_num_draft_tokens > 100
        rates[name] = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
        assert_draft_kv_empty(engine)
    assert rates["self"] >= 0.95, rates  # the same model drafts the target's own argmax
    assert rates["other"] < 0.5, rates  # another random model rarely agrees


def committed_histories(engine: LLMEngine, prompt: list[int], n: int) -> list[list[int]]:
    """Committed token lists as a target might leave them after successive verifications: its own
    greedy path, extended by 1..5 tokens at a time."""
    path = prompt + engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].output_token_ids
    g = torch.Generator().manual_seed(1)
    ends, end = [], len(prompt)
    while end < len(path):
        ends.append(end)
        end += int(torch.randint(1, 6, (1,), generator=g))
    return [path[:e] for e in ends]


def test_the_draft_kv_follows_the_committed_tokens_as_a_fresh_draft_would(engines):
    """After any accepted prefix plus a correction, the kept proposer rolls its KV back and drafts
    exactly what a proposer that computes everything from scratch drafts."""
    target, draft, _ = engines
    cfg = read_engine_config(target)
    kept = DraftModelProposer(draft, cfg)
    plain = LLMEngine.from_engine_dir(draft)
    p0, p1 = prompts()[1], prompts()[2]
    for h0, h1 in zip(committed_histories(plain, p0, 30), committed_histories(plain, p1, 30)):
        asks = [ProposalRequest("a", h0[:len(p0)], h0[len(p0):], 4),
                ProposalRequest("b", h1[:len(p1)], h1[len(p1):], 3)]
        fresh = DraftModelProposer(draft, cfg).propose(asks)
        assert kept.propose(asks) == fresh
        assert [len(d) for d in fresh] == [4, 3]
    # A reused id with another history (not the engine's way) is recomputed where it differs.
    other = [ProposalRequest("a", p1[:5], [7, 8, 9], 4)]
    assert kept.propose(other) == DraftModelProposer(draft, cfg).propose(other)
    kept.forget("a")
    kept.forget("b")
    assert kept.kv.num_used_blocks == 0 and kept.num_requests == 0


def test_aborted_and_finished_requests_free_every_draft_block(engines):
    target, draft, _ = engines
    engine = LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(target)))
    rids = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts()]
    while engine.stats().spec_decode_num_drafts < 3:
        engine.step()
    assert engine.spec.proposer.kv.num_used_blocks > 0
    for rid in rids[1:]:
        assert engine.abort(rid)
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            finals[o.request_id] = o
    assert finals[rids[0]].finish_reason == "length" and finals[rids[0]].num_accepted_tokens > 0
    assert all(finals[r].finish_reason == "abort" for r in rids[1:])
    assert_draft_kv_empty(engine)


def test_a_full_draft_pool_costs_drafts_not_requests(engines):
    target, _, tmp = engines
    ckpt = make_checkpoint(tmp / "small-pool-ckpt", "llama", num_hidden_layers=1)
    small = build(tmp, "small-pool", ckpt, kv_cache_memory="32KiB")  # 32 blocks: the four requests need 71
    engine = LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(small)))
    assert engine.spec.proposer.kv.num_blocks == 32
    assert greedy(engine) == greedy(LLMEngine.from_engine_dir(target))
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert_draft_kv_empty(engine)


def test_a_sequence_longer_than_the_drafts_max_seq_len_gets_no_drafts(engines):
    target, _, tmp = engines
    short = build(tmp, "short", make_checkpoint(tmp / "short-ckpt", "llama", num_hidden_layers=1), max_seq_len=24)
    engine = LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(short)))
    out = engine.generate([prompts()[1]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.output_token_ids == LLMEngine.from_engine_dir(target).generate(
        [prompts()[1]], SamplingParams(max_tokens=40, ignore_eos=True))[0].output_token_ids
    # With n committed tokens the draft can feed drafts up to position 23: k = min(4, 25 - n), n from
    # 18 (prompt + first token) growing by at least one a step; none once n > 24.
    most = sum(min(4, 25 - n) for n in range(18, 25))
    assert 0 < out.num_draft_tokens <= most
    assert_draft_kv_empty(engine)


# ---- refusals ---------------------------------------------------------------------------------
def retokenized(tmp, name, src):
    """A checkpoint like `src` whose tokenizer maps two tokens to each other's ids (same size)."""
    out = tmp / name
    shutil.copytree(src, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def test_a_draft_of_another_vocabulary_is_refused_naming_both(engines):
    target, _, tmp = engines
    bigger = build(tmp, "bigger-vocab", make_checkpoint(tmp / "bigger-ckpt", "llama", vocab_size=640))
    with pytest.raises(ValueError, match=r"'.*bigger-vocab' has vocab_size=640, the target \d+"):
        LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(bigger)))
    swapped = build(tmp, "swapped", retokenized(tmp, "swapped-ckpt", tmp / "draft-ckpt"))
    differs = (r"'.*swapped': its tokenizer differs from the target's in tokenizer.json "
               r"\(draft sha256 tokenizer.json=[0-9a-f]{12}, target tokenizer.json=[0-9a-f]{12}\)")
    with pytest.raises(ValueError, match=differs):
        LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(swapped)))


def test_a_missing_draft_and_unsupported_drafts_are_refused(engines, tmp_path):
    target, draft, _ = engines
    with pytest.raises(ValueError, match="'.*no-such-engine' is not a trtforge engine directory"):
        LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=config(tmp_path / "no-such-engine")))
    cfg, dcfg = read_engine_config(target), read_engine_config(draft)
    with pytest.raises(ValueError, match=r"is a tensor-parallel engine \(tp_size=2\)"):
        check_draft(dataclasses.replace(dcfg, tp_size=2), "d", cfg, "cpu")
    with pytest.raises(ValueError, match="is the tensorrt backend"):
        check_draft(dataclasses.replace(dcfg, backend="tensorrt"), "d", cfg, "cpu")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        check_draft(dcfg, "d", cfg, "cuda")
    check_draft(dcfg, "d", cfg, "cpu")


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model"}, 'method draft_model needs "model"'),
    ({"method": "draft_model", "model": " "}, 'method draft_model needs "model"'),
    ({"model": "somewhere"}, "model='somewhere' is only read by method draft_model"),
])
def test_the_config_names_what_draft_model_needs(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": "/engines/draft"})
    assert SpeculativeConfig.parse(spec.to_json()) == spec
