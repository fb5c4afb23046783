"""Sampled speculative decoding with draft_model keeps the target's distribution: a greedy draft
is a point-mass proposal, which rejection.py's sampling (accept d with p(d), else draw from p
without d) handles exactly as for ngram. Checked as test_sampling.py checks ngram: a tiny-vocabulary
target's tokens at positions 1..3 over a few thousand seeded requests, with and without drafts,
by chi-square tests — with the target as its own draft (drafts accepted often) and with another
random model (mostly rejected: the residual draws)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from tests.serving.spec_decode.test_sampling import P_MIN, first_tokens, two_sample_pvalue
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB = 16


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """(target, another draft): vocabulary 16, the same tokenizer files."""
    tmp = tmp_path_factory.mktemp("draft-sampling")
    limits = BuildConfig(dtype="float32", max_batch_size=64, max_num_tokens=512, max_seq_len=64,
                         kv_cache_memory="8MiB", kv_block_size=4)
    out = []
    for name, seed in (("target", 0), ("other", 9)):
        ckpt = make_checkpoint(tmp / f"{name}-ckpt", arch="llama", vocab_size=VOCAB, init_std=0.3, seed=seed)
        out.append(build_engine(str(ckpt), tmp / name, limits, progress=False)[0])
    return out


@pytest.mark.parametrize("which", ["self", "other"])
def test_the_distribution_is_the_same_with_and_without_a_draft_model(tiny_vocab, which):
    target, other = tiny_vocab
    plain = LLMEngine.from_engine_dir(target)
    prompt = [3, 7, 1, 12, 5]
    cfg = SpeculativeConfig(method="draft_model", model=str(target if which == "self" else other),
                            num_speculative_tokens=3, disable_by_batch_size=None, backoff_after_rejections=0)
    spec = LLMEngine.from_engine_dir(target, RuntimeConfig(speculative_config=cfg))
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    n = 2500
    a, b = first_tokens(plain, prompt, params, n), first_tokens(spec, prompt, params, n)
    stats = spec.stats()
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts >= n, "every request must verify drafts"
    if which == "self":  # the target's argmax: accepted with its probability, often and not always
        assert 0.3 < rate < 0.95, f"acceptance {rate:.2f}: both accepts and rejects must occur"
    else:  # another model's argmax: nearly always rejected, so the residual draws are tested
        assert rate < 0.2, f"acceptance {rate:.2f}"
    for pos in range(1, 4):  # position 0 comes from the prefill, never from a verification
        ca, cb = torch.zeros(VOCAB), torch.zeros(VOCAB)
        for x, y in zip(a, b):
            ca[x[pos]] += 1
            cb[y[pos]] += 1
        assert two_sample_pvalue(ca, cb) > P_MIN, f"position {pos}: {ca.tolist()} vs {cb.tolist()}"
    pairs_a, pairs_b = torch.zeros(VOCAB * VOCAB), torch.zeros(VOCAB * VOCAB)
    for x, y in zip(a, b):  # the joint of positions 1 and 2 (a draft accepted, then what follows)
        pairs_a[x[1] * VOCAB + x[2]] += 1
        pairs_b[y[1] * VOCAB + y[2]] += 1
    assert two_sample_pvalue(pairs_a, pairs_b) > P_MIN
    assert stats.kv_blocks_used == 0 and spec.spec.proposer.kv.num_used_blocks == 0
