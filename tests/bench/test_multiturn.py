"""The multi-turn workload's conversations (the benchmark's serving side is the e2e fleet)."""

from __future__ import annotations

import pytest

from trtforge.bench.multiturn import MultiTurnConfig, conversation_openings


def test_conversations_are_deterministic_and_runs_share_no_prefix():
    cfg = MultiTurnConfig(sessions=3, turns=2, context_words=20, user_words=5)
    a, again, b = (conversation_openings(cfg, t) for t in ("kv-0", "kv-0", "round-robin-0"))
    assert a == again and len(a) == 3 and all(len(users) == 2 for _, users in a)
    contexts = [c for c, _ in a] + [c for c, _ in b]
    assert len({c.split("]")[0] for c in contexts}) == 6  # every session's text starts with its own tag
    assert all(len(c.split()) == 21 for c in contexts)


def test_a_workload_with_nothing_in_it_is_refused():
    with pytest.raises(ValueError, match="turns=0"):
        MultiTurnConfig(turns=0)
