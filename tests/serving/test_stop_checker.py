"""StopChecker: EOS, stop tokens, min_tokens, length limits, and stop strings across tokens."""

from __future__ import annotations

import random
import time

import pytest

from tests.helpers.tokenizers import byte_level_tokenizer
from trtforge.config.sampling import SamplingParams
from trtforge.serving.detokenizer import IncrementalDetokenizer
from trtforge.serving.sampler import SamplingState
from trtforge.serving.stop_checker import StopChecker

EOS = 0
TOKEN = 50  # an ordinary token


def _state(prompt_len=3, **params) -> SamplingState:
    params.setdefault("max_tokens", 100)
    return SamplingState(SamplingParams(**params).validate(), [7] * prompt_len,
                         eos_token_ids=(EOS,))


def _feed(checker, state, tokens_and_deltas):
    """Run tokens through the checker; return (finish reasons, emitted texts)."""
    reasons, texts = [], []
    for token, delta in tokens_and_deltas:
        state.output_token_ids.append(token)
        reason, text = checker.check(state, token, delta)
        reasons.append(reason)
        texts.append(text)
        if reason is not None:
            break
    return reasons, texts


def test_eos_stops_unless_ignored():
    checker, state = StopChecker(), _state()
    assert _feed(checker, state, [(TOKEN, "a"), (EOS, "")]) == ([None, "stop"], ["a", ""])
    assert checker.stop_reason == EOS
    reasons, _ = _feed(StopChecker(), _state(ignore_eos=True), [(TOKEN, "a"), (EOS, "")])
    assert reasons == [None, None]


def test_stop_token_ids_and_min_tokens():
    reasons, _ = _feed(StopChecker(), _state(stop_token_ids=[9]), [(TOKEN, "a"), (9, "b")])
    assert reasons == [None, "stop"]
    # min_tokens=2: stop conditions count only once two tokens precede the stopping one.
    state = _state(min_tokens=2, stop_token_ids=[9], stop=["x"])
    reasons, texts = _feed(StopChecker(), state, [(EOS, ""), (9, "x"), (EOS, "")])
    assert reasons == [None, None, "stop"] and texts == ["", "x", ""]


def test_length_limits():
    reasons, _ = _feed(StopChecker(), _state(max_tokens=3), [(TOKEN, "a")] * 5)
    assert reasons == [None, None, "length"]
    checker = StopChecker(max_seq_len=6)  # 4 prompt tokens: room for 2 outputs
    reasons, _ = _feed(checker, _state(prompt_len=4), [(TOKEN, "a")] * 5)
    assert reasons == [None, "length"] and checker.stop_reason is None


def test_stop_string_spanning_three_tokens_is_cut():
    checker = StopChecker()
    reasons, texts = _feed(checker, _state(stop=["STOP"]),
                           [(1, "abc S"), (2, "T"), (3, "OP def"), (4, "more")])
    assert reasons == [None, None, "stop"]
    assert texts == ["abc ", "", ""]  # "S", "ST" held back, never sent
    assert checker.stop_reason == "STOP"


def test_include_stop_str_in_output():
    _, texts = _feed(StopChecker(), _state(stop=["STOP"], include_stop_str_in_output=True),
                     [(1, "abc S"), (2, "T"), (3, "OP def")])
    assert "".join(texts) == "abc STOP"


def test_partial_match_is_released_when_broken():
    reasons, texts = _feed(StopChecker(), _state(stop=["STOP"]), [(1, "xx ST"), (2, "ORM"),
                                                                  (3, " S"), (4, "!")])
    assert reasons == [None] * 4
    assert texts == ["xx ", "STORM", " ", "S!"]


def test_earliest_stop_string_wins():
    _, texts = _feed(StopChecker(), _state(stop=["world", "lo w"]), [(1, "hello world")])
    assert texts == ["hel"]


def test_length_finish_releases_held_text():
    reasons, texts = _feed(StopChecker(), _state(max_tokens=2, stop=["STOP"]),
                           [(1, "ok"), (2, " ST")])
    assert reasons == [None, "length"] and "".join(texts) == "ok ST"


def test_token_must_be_appended_first():
    state = _state()
    with pytest.raises(ValueError, match="append it to state.output_token_ids"):
        StopChecker().check(state, TOKEN, "a")


def test_with_real_tokenizer_and_detokenizer():
    tok = byte_level_tokenizer()
    stop = "\n\nUser:"
    ids = tok.encode("The answer is 42 — café.\n\nUser: more text", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    checker, state = StopChecker(), _state(stop=[stop], max_tokens=len(ids) + 5)
    emitted = ""
    for token in ids:
        state.output_token_ids.append(token)
        delta = detok.step([token])
        reason, text = checker.check(state, token, delta)
        emitted += text
        assert "The answer is 42 — café.".startswith(emitted)  # never retracted
        if reason:
            break
    assert reason == "stop" and emitted == "The answer is 42 — café."
    assert len(tok.encode(stop, add_special_tokens=False)) >= 3  # "\n\n", "User", ":" at least


def test_random_splits_match_reference():
    rng = random.Random(0)
    alphabet = "ab c\né中"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randrange(1, 5)] if rng.random() < 0.7 else "zz"
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randrange(1, 8))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts)]
        if cuts[-1] != len(text):
            deltas.append(text[cuts[-1]:])
        tokens = [(TOKEN, d) for d in deltas]
        reasons, texts = _feed(StopChecker(), _state(stop=[stop], max_tokens=len(deltas)), tokens)
        found = text.find(stop)
        expected = text if found == -1 else text[:found]
        assert "".join(texts) == expected, (text, stop, deltas)
        assert reasons[-1] == ("length" if found == -1 else "stop")


def _reference_texts(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None]:
    """The scan as it was before the KMP matcher (find each stop in held + delta, hold the longest
    partial match back): what the matcher must reproduce exactly."""
    held, texts = "", []
    for delta in deltas:
        buf = held + delta
        found = [(buf.find(s), k, s) for k, s in enumerate(stops) if buf.find(s) != -1]
        if found:
            at, _, stop = min(found)
            texts.append(buf[:at])
            return texts, stop
        keep = max((n for s in stops for n in range(1, min(len(s) - 1, len(buf)) + 1)
                    if buf.endswith(s[:n])), default=0)
        held = buf[len(buf) - keep:] if keep else ""
        texts.append(buf[: len(buf) - keep])
    return texts, None


def test_several_overlapping_stop_strings_match_the_reference():
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("aab") for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 7)))
                 for _ in range(rng.randrange(1, 5))]
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randrange(1, 10)))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts)] + ([text[cuts[-1]:]] if cuts[-1] < len(text) else [])
        checker = StopChecker()
        reasons, texts = _feed(checker, _state(stop=stops, max_tokens=len(deltas) + 1),
                               [(TOKEN, d) for d in deltas])
        expected, stop = _reference_texts(stops, deltas)
        assert texts == expected, (text, stops, deltas)
        assert checker.stop_reason == stop and (reasons[-1] == "stop") == (stop is not None)


def test_stop_scan_is_linear_in_the_new_text():
    # 64 stop strings of 1024 characters; the output keeps almost matching the last one, so 1023
    # characters stay held back. The scan before the KMP matcher tried every prefix length of the
    # other 63 against that text at every token (~0.03 s a token, over a minute here); now ~0.2 s.
    stops = [chr(ord("b") + k) * 1024 for k in range(63)] + ["a" * 1023 + "x"]
    checker, state = StopChecker(), _state(stop=stops, max_tokens=100_000)
    started = time.perf_counter()
    for _ in range(3000):
        state.output_token_ids.append(TOKEN)
        reason, _ = checker.check(state, TOKEN, "a")
        assert reason is None
    assert time.perf_counter() - started < 3.0
    assert len(checker.release()) == 1023  # held back: what could still become a stop string
