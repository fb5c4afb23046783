"""Sampled speculative decoding keeps the target's distribution: rejection sampling of point-mass
(n-gram) drafts, checked by chi-square tests — the verifier's committed tokens against the
distribution the plain sampler draws from, and a tiny-vocabulary engine's first tokens with and
without speculation over a few thousand seeded requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.engine import LLMEngine
from trtforge.serving.sampler import SamplingState, process_logits, sampling_probs
from trtforge.serving.spec_decode.rejection import verify

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
P_MIN = 1e-3  # a correct sampler fails one of these tests about once in a thousand runs


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of counts to expected counts (cells expecting < 5 pooled into one)."""
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().view(1)]).double()
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64), stat / 2))


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors come from one distribution (a 2 x V table)."""
    keep = (a + b) >= 10
    a = torch.cat([a[keep], a[~keep].sum().view(1)]).double()
    b = torch.cat([b[keep], b[~keep].sum().view(1)]).double()
    if a[-1] + b[-1] == 0:
        a, b = a[:-1], b[:-1]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = ((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum()
    return float(torch.special.gammaincc(torch.tensor((len(a) - 1) / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=0.8, repetition_penalty=1.3),
])
def test_verified_tokens_follow_the_plain_samplers_distribution(params):
    g = torch.Generator().manual_seed(0)
    vocab, trials = 8, 4000
    logits = torch.randn(3, vocab, generator=g) * 1.5
    state = SamplingState(params=params, prompt_token_ids=[1, 2, 3], output_token_ids=[4], seed=7)

    def target(j: int, before: list[int]) -> torch.Tensor:  # what one-by-one sampling draws from
        return sampling_probs(process_logits(logits[j:j + 1], [state.extended(before)]), [params])[0]

    p0 = target(0, [])
    d0 = int(p0.argmax())  # likely, so that position 1 is reached often
    p1 = target(1, [d0])
    d1 = int(p1.argsort()[-2])  # the second most likely: accepted sometimes, rejected often
    drafts, probs = [d0, d1], [p0, p1]
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # the token after an accepted first draft
    for _ in range(trials):
        out = verify(logits, state, drafts).token_ids
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert chi2_pvalue(first, probs[0] * trials) > P_MIN
    assert second.sum() > 200, "the first draft must be accepted often enough to test the second position"
    assert chi2_pvalue(second, probs[1] * second.sum()) > P_MIN


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    logits = torch.full((3, 6), -30.0)
    logits[0, 3] = logits[1, 4] = 10.0  # the target is (almost) sure of 3, then 4
    logits[2] = 0.0
    state = SamplingState(params=SamplingParams(temperature=1.0, top_k=1), prompt_token_ids=[1], seed=1)
    assert verify(logits, state, [3, 4]).num_accepted == 2
    impossible = verify(logits, state, [5, 4])
    assert impossible.num_accepted == 0 and impossible.token_ids == [3]


@pytest.fixture(scope="module")
def tiny_vocab_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec-sampling")
    ckpt = make_checkpoint(tmp / "ckpt", arch="llama", vocab_size=16, init_std=0.3)
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=64, max_num_tokens=512, max_seq_len=64,
                                      kv_cache_memory="8MiB", kv_block_size=4), progress=False)
    return out


def first_tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    outs = engine.generate([prompt] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
    return [o.output_token_ids for o in outs]


def test_engine_distribution_is_the_same_with_and_without_speculation(tiny_vocab_engine):
    plain = LLMEngine.from_engine_dir(tiny_vocab_engine)
    greedy = plain.generate([[3, 7, 1]], SamplingParams(max_tokens=40, ignore_eos=True))[0].output_token_ids
    prompt = [3, 7, 1] + greedy  # the model's own greedy path: drafts from it are often likely
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                            disable_by_batch_size=None, backoff_after_rejections=0)
    spec = LLMEngine.from_engine_dir(tiny_vocab_engine, RuntimeConfig(speculative_config=cfg))
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    n = 2500
    a, b = first_tokens(plain, prompt, params, n), first_tokens(spec, prompt, params, n)
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens > n // 2, "drafts must be accepted often to mean anything"
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, "and rejected too"
    for pos in range(1, 4):  # position 0 comes from the prefill, never from a verification
        ca, cb = torch.zeros(16), torch.zeros(16)
        for x, y in zip(a, b):
            ca[x[pos]] += 1
            cb[y[pos]] += 1
        assert two_sample_pvalue(ca, cb) > P_MIN, f"position {pos}: {ca.tolist()} vs {cb.tolist()}"
    pairs_a = torch.zeros(256)
    pairs_b = torch.zeros(256)
    for x, y in zip(a, b):  # the joint of positions 1 and 2 (a draft accepted, then what follows)
        pairs_a[x[1] * 16 + x[2]] += 1
        pairs_b[y[1] * 16 + y[2]] += 1
    assert two_sample_pvalue(pairs_a, pairs_b) > P_MIN
    assert stats.kv_blocks_used == 0


def test_seeded_requests_repeat_with_speculation(tiny_vocab_engine):
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None)
    runs = []
    for _ in range(2):
        engine = LLMEngine.from_engine_dir(tiny_vocab_engine, RuntimeConfig(speculative_config=cfg))
        outs = engine.generate([[3, 7, 1, 3, 7, 1, 3, 7]] * 4,
                               [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
                                for s in (1, 2, 3, 1)])
        runs.append([o.output_token_ids for o in outs])
    assert runs[0] == runs[1], "the same seeds give the same tokens"
    assert runs[0][0] == runs[0][3], "whatever else is in the batch"
