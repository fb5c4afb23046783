"""Prompt lookup and the adaptive rule, on plain token lists."""

import random

from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.spec_decode.controller import SpecDecodeController
from trtforge.serving.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: longest n first, latest earlier occurrence, what followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


def test_lookup_matches_its_definition_on_random_sequences():
    rng = random.Random(0)
    proposer = NgramProposer(1, 4)
    for trial in range(3000):
        tokens = [rng.choice([0, 1, 2, 3, 70000, -1 & 0x7FFFFFFF]) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 6)
        assert proposer.propose_one(f"r{trial}", tokens[:3], tokens[3:], k) == brute_force(tokens, 1, 4, k), tokens


def test_the_packed_tokens_follow_a_growing_request():
    proposer = NgramProposer(2, 3)
    tokens = [5, 6, 7, 8, 5, 6]
    assert proposer.propose_one("a", tokens[:2], tokens[2:], 3) == [7, 8, 5]
    tokens += [9, 5, 6]
    assert proposer.propose_one("a", tokens[:2], tokens[2:], 3) == [9, 5, 6], "the latest occurrence wins"
    proposer.forget("a")
    assert proposer.propose_one("a", [1, 2, 3], [], 2) == []


def test_min_n_bounds_the_match_and_no_repeat_proposes_nothing():
    assert NgramProposer(2, 4).propose_one("a", [1, 2, 3, 4, 9, 4], [], 3) == []
    assert NgramProposer(1, 4).propose_one("a", [1, 2, 3, 4], [9, 4], 3) == [9, 4]


def test_batch_size_rule_and_backoff():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2,
                            backoff_after_rejections=2)
    ctl = SpecDecodeController(cfg)
    rep = [1, 2, 3, 1, 2]
    assert ctl.propose([("a", rep, [], 10)]) == {"a": [3, 1, 2]}
    assert ctl.propose([("a", rep, [], 3)]) == {"a": [3, 1]}, "capped by what max_tokens leaves"
    assert ctl.propose([("a", rep, [], 1)]) == {}, "one token left: nothing to verify"
    assert ctl.propose([(r, rep, [], 10) for r in "abc"]) == {}, "more decodes than disable_by_batch_size"
    ctl.record("a", 3, 0)
    ctl.record("a", 3, 0)  # 2 rejections in a row: 2 steps without proposals
    assert ctl.propose([("a", rep, [], 10)]) == {} and ctl.propose([("a", rep, [], 10)]) == {}
    assert ctl.propose([("a", rep, [], 10)]) == {"a": [3, 1, 2]}
    ctl.record("a", 3, 0)
    ctl.record("a", 3, 0)  # again: 4 steps
    assert [ctl.propose([("a", rep, [], 10)]) for _ in range(5)] == [{}] * 4 + [{"a": [3, 1, 2]}]
    ctl.record("a", 3, 1)  # an accepted draft resets the backoff
    ctl.record("a", 3, 0)
    ctl.record("a", 3, 0)
    assert [ctl.propose([("a", rep, [], 10)]) for _ in range(3)] == [{}] * 2 + [{"a": [3, 1, 2]}]
    s = ctl.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (7, 21, 1)
    assert s.accepted_per_position == [1, 0, 0]
