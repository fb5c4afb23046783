"""The seam every proposer plugs into: plain token ids in, draft token ids out (no tensors of the
target, no scheduler state), so the engine loop and the verification do not change with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trtforge.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.models.engine_dir import EngineConfig


@dataclass
class ProposalRequest:
    """One running decode that may receive drafts this step."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Its committed tokens are prompt + outputs (the engine's own lists: read, never change them)."""
    max_drafts: int
    """Most draft tokens it may take (>= 1): num_speculative_tokens, capped by what max_tokens
    leaves (the verification commits up to max_drafts + 1 tokens)."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt + outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids


class Proposer(Protocol):
    """Proposes up to `max_drafts` next tokens of each request."""

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """One list of draft token ids per request, in order ([] where it has nothing to offer)."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop whatever state the proposer keeps for it."""


def make_proposer(config: SpeculativeConfig, target: EngineConfig | None = None,
                  runtime: RuntimeConfig | None = None) -> Proposer:
    """The proposer `config.method` names (SpeculativeConfig refuses unknown methods). draft_model
    loads its engine here, checked against the `target` engine's vocabulary, on `runtime`'s device."""
    if config.method == "ngram":
        from trtforge.serving.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        if target is None:
            raise ValueError("speculative method draft_model needs the target engine's config to check the "
                             "draft's vocabulary against (make_proposer(config, target, runtime))")
        from trtforge.serving.spec_decode.draft_model import DraftModelProposer

        device = str(runtime.device) if runtime is not None else "cpu"
        verify = runtime.verify_checksums if runtime is not None else True
        return DraftModelProposer.from_config(config, target, device, verify)
    raise ValueError(f"speculative method {config.method!r} has no proposer")
