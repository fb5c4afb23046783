"""The soak's request plan: which kind each of N requests is, on which prompt, and the expected text.

Every request is drawn once, up front, from a seeded RNG, so a run is reproducible and its mix
is known before anything is sent:

* **checked** (~55 %): greedy requests read to the end, over gRPC streaming, HTTP
  `/generate_stream` and HTTP `/generate`; the text must equal the in-process engine's.
* **cut** (~30 %): a gRPC stream cancelled, or an HTTP `/generate_stream` socket closed, after
  0-8 streamed pieces (0: right after sending, before any answer).
* **malformed** (~15 %): bodies and values the server must refuse (bad JSON, wrong types,
  missing or invalid inputs), plus an unknown key, which Triton passes on as a request
  parameter and the model ignores: that one is served and checked like a good request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

PROMPTS = (
    "Hello world", "The quick brown fox", "Café au lait", "Once upon a time, in a land far away,",
    "def fibonacci(n):", "naïve façade — 日本語のテキスト", "1, 2, 3, 4, 5,", "Dear Sir or Madam,",
    "The capital of France is", "stop words; commas, and \"quotes\"", "   leading spaces",
    "A long prompt that repeats itself. " * 6,
)
"""Distinct prompts; the oracle runs each once per max_tokens value."""

CHECKED_MAX_TOKENS = (8, 24)
"""max_tokens of checked requests (each prompt × value has one expected text)."""

CUT_MAX_TOKENS = 96
"""max_tokens of requests cut mid-stream: long enough that they are still generating when cut
(more than CUT_AFTER's largest count), short enough for the longest prompt (150 tokens) to fit
the soak engine's max_seq_len of 256."""

CUT_AFTER = (0, 1, 2, 4, 8)
"""Streamed pieces read before a cut request is cancelled or its socket closed."""

# kind -> share of the requests (sums to 1).
MIX = {
    "grpc_stream": 0.22, "http_stream": 0.15, "http_generate": 0.18,  # checked: 55 %
    "grpc_cancel": 0.15, "http_disconnect": 0.15,                       # cut: 30 %
    "malformed": 0.15,
}

CHECKED_KINDS = ("grpc_stream", "http_stream", "http_generate")
CUT_KINDS = ("grpc_cancel", "http_disconnect")

# Malformed variants: name -> (transport, body or inputs, expected refusal).
# Bodies are raw bytes for HTTP /generate; dicts are sent as JSON. "refuse" means any non-200.
MALFORMED: dict[str, tuple[str, Any]] = {
    "truncated_json": ("http", b'{"text_input": "hi", "max_tokens": 4'),
    "not_json": ("http", b"not json at all"),
    "empty_body": ("http", b""),
    "json_array": ("http", b"[1, 2]"),
    "max_tokens_string": ("http", {"text_input": "hi", "max_tokens": "ten"}),
    "max_tokens_float": ("http", {"text_input": "hi", "max_tokens": 4.5}),
    "temperature_string": ("http", {"text_input": "hi", "max_tokens": 4, "temperature": "hot"}),
    "text_input_number": ("http", {"text_input": 5, "max_tokens": 4}),
    "two_prompts": ("http", {"text_input": ["a", "b"], "max_tokens": 4}),
    "missing_text_input": ("http", {"max_tokens": 4}),
    "missing_max_tokens": ("http", {"text_input": "hi"}),
    "negative_max_tokens": ("http", {"text_input": "hi", "max_tokens": -3}),
    "zero_max_tokens": ("grpc", {"max_tokens": 0}),
    "beam_width_2": ("http", {"text_input": "hi", "max_tokens": 4, "beam_width": 2}),
    "prompt_too_long": ("grpc", {"text_input": "hello " * 400, "max_tokens": 4}),
    "unknown_parameter": ("http", {"max_tokens": CHECKED_MAX_TOKENS[0], "no_such_input": 1}),
}
ACCEPTED_MALFORMED = ("unknown_parameter",)
"""Variants Triton serves (unknown JSON keys become request parameters); checked for text."""


@dataclass(frozen=True)
class Planned:
    """One request of the soak."""

    index: int
    kind: str
    prompt: str
    max_tokens: int
    cut_after: int = 0
    """Pieces to read before cutting (cut kinds)."""
    variant: str = ""
    """Malformed variant name, or an option of a checked kind ("logprobs", "exclude_input")."""

    @property
    def group(self) -> str:
        if self.kind in CHECKED_KINDS:
            return "checked"
        return "cut" if self.kind in CUT_KINDS else "malformed"


def make_plan(num_requests: int, seed: int) -> list[Planned]:
    """`num_requests` requests drawn with MIX's shares, reproducible from `seed`."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    plan = []
    for index in range(num_requests):
        kind = rng.choices(kinds, weights)[0]
        prompt = rng.choice(PROMPTS)
        if kind in CHECKED_KINDS:
            variant = rng.choice(("", "logprobs", "exclude_input"))
            plan.append(Planned(index, kind, prompt, rng.choice(CHECKED_MAX_TOKENS), variant=variant))
        elif kind in CUT_KINDS:
            plan.append(Planned(index, kind, prompt, CUT_MAX_TOKENS, cut_after=rng.choice(CUT_AFTER)))
        else:
            plan.append(Planned(index, kind, prompt, CHECKED_MAX_TOKENS[0],
                                variant=rng.choice(sorted(MALFORMED))))
    return plan


def expected_texts(engine_dir: str, prompts: tuple[str, ...] = PROMPTS,
                   max_tokens: tuple[int, ...] = CHECKED_MAX_TOKENS) -> dict[tuple[str, int], str]:
    """{(prompt, max_tokens): greedy text} from the same engine run in this process (the oracle)."""
    from trtforge.config.sampling import SamplingParams  # torch
    from trtforge.serving.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(engine_dir)
    expected = {}
    for n in max_tokens:
        outs = engine.generate(list(prompts), SamplingParams(max_tokens=n, temperature=0.0))
        expected.update({(p, n): o.text for p, o in zip(prompts, outs)})
    return expected
