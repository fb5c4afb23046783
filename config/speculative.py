"""Speculative decoding: which proposer drafts tokens, how many, and when speculation backs off.

vLLM's shape (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}'`, or `{"method": "draft_model", "model":
"DRAFT_ENGINE_DIR", "num_speculative_tokens": 4}`): one JSON object, read into this documented,
torch-free dataclass by `SpeculativeConfig.parse` (the CLI flag, a Triton parameter, a RuntimeConfig
field). Unknown methods and unknown fields are refused with the list of what is known.

The adaptive rule (docs/speculative-decoding.md) is two fields: `disable_by_batch_size` turns
speculation off for a step with more running decodes than that (verification tokens then cost
compute the batch already uses), and `backoff_after_rejections` pauses one sequence's proposals
after that many verifications in a row accepted nothing (exponentially longer each time, reset
by the first accepted draft), so a workload the proposer cannot predict pays almost nothing.

Where a config comes from: `build-engine --speculative-config` records one in engine.json as the
engine's default; `trtforge generate`, `emit-repo` (a config.pbtxt parameter) and
`RuntimeConfig.speculative_config` override it, and NO_SPECULATION ("none") turns it off.
`unsupported` is the one rule of where speculation cannot run, which the build, the emitter and
the engine all apply.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from trtforge.config.fields import field_docs

METHODS = ("ngram", "draft_model")
"""Proposers implemented (vLLM's names); eagle and mtp heads are not yet."""

NO_SPECULATION = "none"
"""The speculative_config that turns speculation off, whatever the engine's default (engine.json)
says (`--speculative-config none`)."""


def unsupported(backend: str, tp_size: int = 1, context_phase: bool = False) -> str | None:
    """What rules speculative decoding out for an engine of `backend` with `tp_size` ranks (in the
    context phase of disaggregated serving), in words; None where it runs."""
    if tp_size > 1:
        return f"a tensor-parallel engine (tp_size={tp_size})"
    if backend == "trtllm":
        return ("the trtllm backend (TensorRT-LLM's own speculative decoding is configured when "
                "TensorRT-LLM builds its engine, not by trtforge)")
    if backend != "torch":
        return f"the {backend} backend (its plan scores one token per sequence)"
    if context_phase:
        return "the context phase (it computes the prompt and one token: there is nothing to speculate)"
    return None


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates; None in RuntimeConfig = no speculation."""

    method: str = "ngram"
    """The proposer: ngram (prompt lookup: the tokens that followed the latest earlier occurrence
    of the sequence's last n tokens, in its own prompt + output) or draft_model (greedy decoding
    of a smaller trtforge engine, `model`)."""
    model: str | None = None
    """draft_model: the draft's trtforge engine directory (same tokenizer and vocabulary as the
    target; checked when the engine starts). A relative path is read from the working directory.
    ngram: must be left out."""
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per sequence and step (k); one verification step scores all of
    them and commits the accepted ones plus one token of its own."""
    prompt_lookup_max: int = 4
    """ngram: the longest n-gram (last tokens of the sequence) looked up; longer matches are tried
    first."""
    prompt_lookup_min: int = 2
    """ngram: the shortest n-gram looked up (1 proposes after any repeated token)."""
    disable_by_batch_size: int | None = 8
    """No speculation in a step with more running decodes than this (None: any batch)."""
    backoff_after_rejections: int = 3
    """After this many verifications in a row that accepted no draft, a sequence proposes nothing
    for 2, 4, 8, ... (at most 64) decode steps; an accepted draft resets it (0: never back off)."""

    KNOWN: ClassVar[tuple[str, ...]] = ()  # filled below: the field names

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported: known methods are "
                             f"{', '.join(METHODS)} (eagle and mtp are not implemented yet)")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"speculative config: method draft_model needs \"model\": the draft's trtforge engine "
                             f"directory (got model={self.model!r}); e.g. "
                             '{"method": "draft_model", "model": "DRAFT_ENGINE_DIR", "num_speculative_tokens": 4}')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative config: model={self.model!r} is only read by method draft_model "
                             f"(method is {self.method!r}): leave it out, or set \"method\": \"draft_model\"")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "backoff_after_rejections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative config: {name}={value!r} is invalid: expected an integer")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative config: num_speculative_tokens={self.num_speculative_tokens} "
                             "is invalid: must be 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(f"speculative config: prompt_lookup_min={self.prompt_lookup_min} and "
                             f"prompt_lookup_max={self.prompt_lookup_max} are invalid: need "
                             "1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.backoff_after_rejections < 0:
            raise ValueError("speculative config: backoff_after_rejections="
                             f"{self.backoff_after_rejections} is invalid: must be >= 0")
        dbs = self.disable_by_batch_size
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 1):
            raise ValueError(f"speculative config: disable_by_batch_size={dbs!r} is invalid: "
                             "must be an integer >= 1 or null")

    @classmethod
    def parse(cls, value: SpeculativeConfig | str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From a JSON object (text or dict) or an instance; None, "", "none" and "null" are None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "null"):
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config {value!r} is not JSON ({exc.msg}); write e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(cls.KNOWN))
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {unknown}; known: {', '.join(cls.KNOWN)}")
        return cls(**value)

    def to_json(self) -> str:
        """The JSON object `parse` reads back (what a Triton parameter or engine.json holds)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def __str__(self) -> str:
        return self.to_json()

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        return dict(field_docs(cls))


SpeculativeConfig.KNOWN = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))
