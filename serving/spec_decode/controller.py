"""Who proposes how many drafts each step (the adaptive rule), and the counts of what happened.

The rule (SpeculativeConfig; docs/speculative-decoding.md):

* a step with more running decodes than `disable_by_batch_size` proposes nothing: a large batch
  already fills the step with work, and verification tokens would add to it;
* a request may take min(num_speculative_tokens, max_tokens left - 1) drafts, and none when it
  opted out (SamplingParams.speculative false) or is constrained by a grammar;
* after `backoff_after_rejections` verifications in a row accepted no draft, the request proposes
  nothing for 2 decode steps, then 4, 8, ... up to 64 each further time; an accepted draft resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.spec_decode.proposer import ProposalRequest, Proposer, make_proposer

if TYPE_CHECKING:
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.models.engine_dir import EngineConfig

MAX_BACKOFF_STEPS = 64


@dataclass
class SpecDecodeStats:
    """Running totals since start (EngineStats carries them; vLLM's spec_decode counters)."""

    num_drafts: int = 0
    """Verifications: decode steps of a request that carried at least one draft token."""
    num_draft_tokens: int = 0
    """Draft tokens proposed and verified."""
    num_accepted_tokens: int = 0
    """Of those, accepted (each saved one target step)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """[i]: verifications whose draft at position i was accepted."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification (accepted + 1), 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Backoff:
    rejections_in_row: int = 0
    level: int = 0
    skip_steps: int = 0


class SpecDecodeController:
    """Proposals under the adaptive rule, acceptance bookkeeping per request and in total."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None, *,
                 target: EngineConfig | None = None, runtime: RuntimeConfig | None = None):
        """`proposer` left out: the one config.method names, for the `target` engine (draft_model
        checks its draft against it) on `runtime`'s device."""
        self.config = config
        self.proposer = proposer or make_proposer(config, target, runtime)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._backoff: dict[str, _Backoff] = {}

    def propose(self, candidates: list[tuple[str, list[int], list[int], int]]) -> dict[str, list[int]]:
        """Drafts for (request id, prompt, outputs, tokens it may still generate) of the running
        decodes that may speculate; {} when the step is too large."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and len(candidates) > cfg.disable_by_batch_size:
            return {}
        asks = []
        for rid, prompt, output, left in candidates:
            k = min(cfg.num_speculative_tokens, left - 1)
            backoff = self._backoff.get(rid)
            if backoff is not None and backoff.skip_steps > 0:
                backoff.skip_steps -= 1
                continue
            if k >= 1:
                asks.append(ProposalRequest(rid, prompt, output, k))
        if not asks:
            return {}
        drafts = self.proposer.propose(asks)
        return {a.request_id: d[:a.max_drafts] for a, d in zip(asks, drafts) if d}

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`."""
        if num_drafts == 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        limit = self.config.backoff_after_rejections
        if not limit:
            return
        backoff = self._backoff.setdefault(request_id, _Backoff())
        if num_accepted:
            backoff.rejections_in_row, backoff.level = 0, 0
            return
        backoff.rejections_in_row += 1
        if backoff.rejections_in_row >= limit:
            backoff.level += 1
            backoff.skip_steps = min(2 ** backoff.level, MAX_BACKOFF_STEPS)
            backoff.rejections_in_row = 0

    def forget(self, request_id: str) -> None:
        self._backoff.pop(request_id, None)
        self.proposer.forget(request_id)
