"""Sampler: greedy vs HF, seeded reproducibility across batches, filters vs HF warpers,
penalties, min_tokens, bad words, logprobs and the sampled distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trtforge.config.sampling import SamplingParams
from trtforge.serving.sampler import Sampler, SamplingState, process_logits, sampling_probs

V = 64
EOS = 3


def _state(prompt=(1, 2), outputs=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params).validate(), list(prompt), list(outputs),
                         eos_token_ids=(EOS,))


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_plain_greedy_batch_is_argmax():
    logits = _logits(5)
    out = Sampler().sample(logits, [_state() for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5 and out.top_logprobs == [None] * 5


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = _logits(4, seed=1)
    states = [_state(), _state(temperature=1.0, seed=5), _state(), _state(temperature=0.5)]
    out = Sampler().sample(logits, states)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()


def test_greedy_matches_hf_generate():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS,
                         pad_token_id=0, bos_token_id=1)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[1, 17, 42, 5, 9]])
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        state = _state(prompt=prompt[0].tolist(), min_tokens=8, max_tokens=8)
        ids = prompt
        for _ in range(8):
            logits = model(ids).logits[:, -1, :].float()
            token = Sampler().sample(logits, [state]).token_ids[0]
            state.output_token_ids.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert ids.tolist() == expected.tolist()


def _draw(states, steps, logits_seed=0):
    """Sample `steps` times with fresh logits per step; return each row's token list."""
    sampler, tokens = Sampler(), [[] for _ in states]
    for step in range(steps):
        logits = _logits(1, seed=logits_seed + step).expand(len(states), V)
        for row, tok in enumerate(sampler.sample(logits, states).token_ids):
            tokens[row].append(tok)
    return tokens


def test_seeded_sampling_is_independent_of_batch():
    alone = _draw([_state(temperature=1.0, seed=1234)], steps=12)[0]
    batch = [_state(temperature=0.8, seed=7), _state(), _state(temperature=1.0, seed=1234),
             _state(temperature=1.3, top_k=5)]
    assert _draw(batch, steps=12)[2] == alone
    reordered = [_state(temperature=1.0, seed=1234), _state(temperature=2.0)]
    assert _draw(reordered, steps=12)[0] == alone
    assert _draw([_state(temperature=1.0, seed=99)], steps=12)[0] != alone


def test_unseeded_requests_get_distinct_recorded_seeds():
    a, b = _state(temperature=1.0), _state(temperature=1.0)
    assert a.seed != b.seed
    replay = _state(temperature=1.0, seed=a.seed)
    assert _draw([a], steps=6) == _draw([replay], steps=6)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(6, seed=3)
    states = [_state(temperature=1.5, top_k=1, seed=i) for i in range(3)]
    states += [_state(temperature=1.5, top_p=1e-6, seed=i) for i in range(3)]
    assert Sampler().sample(logits, states).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
])
def test_sampling_probs_match_hf_warpers(params):
    logits = _logits(3, seed=4)
    p = SamplingParams(**params)
    warped = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.top_k:
        warped = TopKLogitsWarper(p.top_k)(None, warped)
    if p.top_p < 1.0:
        warped = TopPLogitsWarper(p.top_p)(None, warped)
    if p.min_p:
        warped = MinPLogitsWarper(p.min_p)(None, warped)
    expected = warped.softmax(-1)
    ours = sampling_probs(logits, [p] * 3)
    assert torch.equal(ours > 0, expected > 0)  # same support
    torch.testing.assert_close(ours, expected)


def test_min_p_never_samples_below_threshold():
    logits = _logits(1, seed=5)
    probs = logits.softmax(-1)[0]
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    tokens = set()
    state = _state(temperature=1.0, min_p=0.1, seed=3)
    for _ in range(200):
        tokens.add(Sampler().sample(logits, [state]).token_ids[0])
    assert tokens <= allowed and len(tokens) > 1


def test_repetition_penalty_matches_hf():
    logits = _logits(2, seed=6)
    states = [_state(prompt=[4, 5, 5], outputs=[9, 10], repetition_penalty=1.7),
              _state(prompt=[11], outputs=[12, 4], repetition_penalty=0.6)]
    ours = process_logits(logits, states)
    for row, state in enumerate(states):
        ids = torch.tensor([state.prompt_token_ids + state.output_token_ids])
        hf = RepetitionPenaltyLogitsProcessor(state.params.repetition_penalty)(
            ids, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], hf, rtol=0, atol=0)


def test_presence_and_frequency_penalties_hand_computed():
    logits = _logits(1, seed=7)
    state = _state(prompt=[20, 21], outputs=[7, 7, 7, 8], presence_penalty=0.5,
                   frequency_penalty=0.25)
    out = process_logits(logits, [state])[0]
    expected = logits[0].clone()
    expected[7] -= 0.5 + 3 * 0.25
    expected[8] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(out, expected)  # prompt tokens 20, 21 untouched


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 2.0, 1.5
    assert Sampler().sample(logits, [_state(prompt=[10])]).token_ids == [10]
    assert Sampler().sample(logits, [_state(prompt=[10], repetition_penalty=2.0)]).token_ids == [11]


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 30], logits[0, 31] = 10.0, 9.0, 1.0
    sampler = Sampler()
    for produced in range(3):
        state = _state(outputs=[40] * produced, min_tokens=3, stop_token_ids=[30])
        assert sampler.sample(logits, [state]).token_ids == [31]
    assert sampler.sample(logits, [_state(outputs=[40] * 3, min_tokens=3)]).token_ids == [EOS]
    ignoring = _state(min_tokens=3, ignore_eos=True)  # EOS does not stop it: no need to mask
    assert sampler.sample(logits, [ignoring]).token_ids == [EOS]


def test_bad_words_single_and_multi_token():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 7] = 9.0, 8.0, 7.0
    sampler = Sampler()
    single = _state(bad_words_ids=[[5]])
    assert sampler.sample(logits, [single]).token_ids == [6]
    # [20, 21, 6]: 6 is banned only right after 20, 21.
    assert sampler.sample(logits, [_state(outputs=[20, 21], bad_words_ids=[[5], [20, 21, 6]])]
                          ).token_ids == [7]
    assert sampler.sample(logits, [_state(outputs=[21, 20], bad_words_ids=[[5], [20, 21, 6]])]
                          ).token_ids == [6]
    random_row = _state(temperature=1.0, seed=0, outputs=[20, 21], bad_words_ids=[[20, 21, 5]])
    hot = torch.full((1, V), -30.0)
    hot[0, 5], hot[0, 6] = 5.0, 0.0
    draws = {sampler.sample(hot, [random_row]).token_ids[0] for _ in range(50)}
    assert 5 not in draws


def test_logprobs_are_raw_log_softmax():
    logits = _logits(3, seed=8)
    states = [_state(logprobs=0), _state(logprobs=4, temperature=1.0, seed=1,
                                         repetition_penalty=1.5), _state()]
    out = Sampler().sample(logits, states)
    raw = torch.log_softmax(logits, -1)
    for row in (0, 1):
        assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-6)
    assert out.top_logprobs[0] == []
    vals, ids = raw[1].topk(4)
    assert [t for t, _ in out.top_logprobs[1]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[1]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.2, top_k=4)])
def test_sampled_frequencies_follow_distribution(params):
    """Chi-square goodness of fit over 3000 seeded draws (deterministic, not flaky)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0]])
    p = SamplingParams(**params, seed=2024)
    probs = sampling_probs(logits, [p])[0]
    state = SamplingState(p, [0])
    draws = 3000
    counts = torch.zeros(logits.shape[1])
    for _ in range(draws):
        counts[Sampler().sample(logits, [state]).token_ids[0]] += 1
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * draws
    chi2 = (((counts[support] - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0, (chi2, counts.tolist(), expected.tolist())  # df <= 5: p ≈ 1e-4


def test_out_of_vocab_stop_token_is_explained():
    out = Sampler().sample(_logits(1), [_state(bad_words_ids=[[V + 5]])])
    assert out.token_ids == [-1] and out.logprobs == [None]
    assert "bad_words_ids contains [69] with token id 69" in out.errors[0]
    assert f"vocabulary of {V} tokens" in out.errors[0]


def _good_batch() -> list[SamplingState]:
    """Rows of every kind: plain greedy, seeded random with filters, penalties and masks, logprobs."""
    return [_state(), _state(temperature=1.0, seed=11, top_p=0.9, logprobs=2),
            _state(outputs=[5, 6], repetition_penalty=1.3, presence_penalty=0.2,
                   bad_words_ids=[[6, 7]], min_tokens=4, stop_token_ids=[9]),
            _state(temperature=0.8, top_k=8, min_p=0.05, seed=3)]


def _unchecked(**params) -> SamplingState:
    """A state whose parameters never went through validate(): what the sampler must survive."""
    return SamplingState(SamplingParams(**params), [1, 2], eos_token_ids=(EOS,))


HOSTILE = {
    "huge stop token with min_tokens": dict(stop_token_ids=[10**9], min_tokens=2),
    "out-of-vocab bad word": dict(bad_words_ids=[[1, V]]),
    "negative bad word": dict(bad_words_ids=[[-3]]),
    "nan temperature": dict(temperature=float("nan")),
    "inf temperature": dict(temperature=float("inf")),
    "huge temperature": dict(temperature=1e300),
    "zero repetition penalty": dict(repetition_penalty=0.0),
    "nan presence penalty": dict(presence_penalty=float("nan")),
    "huge top_k list": dict(top_k="all"),
    "logprobs of the whole vocab": dict(logprobs=10**6),
    "every token banned": dict(bad_words_ids=[[t] for t in range(V)]),
}


@pytest.mark.parametrize("hostile", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_row_fails_alone_and_the_others_sample_as_alone(hostile):
    logits = _logits(5, seed=4)
    alone_states, states = _good_batch(), _good_batch()
    states.insert(1, _unchecked(**HOSTILE[hostile]))
    mixed = torch.cat([logits[:1], logits[4:5], logits[1:4]])
    good = [0, 2, 3, 4]
    for _ in range(3):  # the seeded rows keep drawing the same streams as alone
        alone = [Sampler().sample(logits[i:i + 1], [s]) for i, s in enumerate(alone_states)]
        out = Sampler().sample(mixed, states)
        assert list(out.errors) == [1] and out.token_ids[1] == -1, out.errors
        assert [out.token_ids[i] for i in good] == [a.token_ids[0] for a in alone]
        assert [out.logprobs[i] for i in good] == [a.logprobs[0] for a in alone]
        assert [out.top_logprobs[i] for i in good] == [a.top_logprobs[0] for a in alone]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 1, "top_p": 0.9}])
def test_every_token_masked_fails_that_row(sampling):
    state = _state(bad_words_ids=[[t] for t in range(V) if t != 7], **sampling)
    logits = _logits(3, seed=5)
    logits[0, 7] = float("-inf")  # the one token left is impossible too
    nan_row = _state(repetition_penalty=1.2, **sampling)  # not plain greedy: its row is checked
    logits[2, 9] = float("nan")  # e.g. a broken kernel: never a token
    out = Sampler().sample(logits, [state, _state(), nan_row])
    assert "no token can be sampled" in out.errors[0] and "no token can be sampled" in out.errors[2]
    assert out.token_ids == [-1, logits[1].argmax().item(), -1] and list(out.errors) == [0, 2]


def test_unexpected_batch_failure_is_isolated_to_its_row(monkeypatch):
    from trtforge.serving import sampler as sampler_mod

    original = sampler_mod._apply_penalties

    def exploding(logits, states):
        if any(s.params.presence_penalty == 1.5 for s in states):
            raise RuntimeError("boom")
        original(logits, states)

    monkeypatch.setattr(sampler_mod, "_apply_penalties", exploding)
    logits = _logits(5, seed=6)
    expected = [Sampler().sample(logits[i:i + 1], [s]).token_ids[0] for i, s in enumerate(_good_batch())]
    states = _good_batch()
    states.append(_state(presence_penalty=1.5))
    out = Sampler().sample(logits, states)
    assert out.errors == {4: "sampling failed: RuntimeError: boom"}
    assert out.token_ids[:4] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_logits_seeded_and_greedy():
    logits = _logits(4, seed=9).cuda()

    def batch():
        return [_state(temperature=1.0, seed=11, top_p=0.9), _state(),
                _state(outputs=[5, 6], repetition_penalty=1.3, presence_penalty=0.2,
                       bad_words_ids=[[6, 7]], min_tokens=4, logprobs=2),
                _state(temperature=0.8, top_k=8, min_p=0.05, seed=3)]

    sampler, first, second = Sampler(), batch(), batch()
    a = [sampler.sample(logits, first).token_ids for _ in range(5)]
    alone = _state(temperature=1.0, seed=11, top_p=0.9)
    assert [sampler.sample(logits[:1], [alone]).token_ids[0] for _ in range(5)] == [r[0] for r in a]
    assert a == [sampler.sample(logits, second).token_ids for _ in range(5)]
    assert a[0][1] == logits[1].argmax().item()
    assert a[0][2] == process_logits(logits, first)[2].argmax().item()
