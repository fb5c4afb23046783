"""Sampling one step's logits when some chunks verify drafts: plain rows through the Sampler as
always, each verification through `rejection.verify`; a request that fails fails alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtforge.serving.core.scheduler import SchedulerOutput
from trtforge.serving.sampler import Sampler, SamplingState
from trtforge.serving.spec_decode.rejection import verify
from trtforge.serving.worker.model_inputs import ModelInputs

TopLogprobs = list[tuple[int, float]]
Logprob = tuple[float, TopLogprobs]


@dataclass
class StepTokens:
    """What one step commits, per request id."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    """Committed tokens (one, or a verification's accepted drafts + one)."""
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    """Per committed token (requests that asked for logprobs)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests that could not be sampled, and why."""
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Verifications: (drafts verified, drafts accepted)."""


def step_drafts(sched: SchedulerOutput) -> dict[str, list[int]]:
    """{request id: its drafts} of this step's verification chunks."""
    return {c.seq_id: c.token_ids[len(c.token_ids) - c.num_draft_tokens:]
            for c in sched.chunks if c.sample and c.num_draft_tokens}


def sample_step(sampler: Sampler, logits: torch.Tensor, inputs: ModelInputs, sched: SchedulerOutput,
                states: dict[str, SamplingState]) -> StepTokens:
    """Commit tokens from `logits` (rows in `inputs.sample_num_rows` groups)."""
    out = StepTokens()
    drafts = step_drafts(sched)
    plain: list[tuple[str, int]] = []  # (request id, logits row)
    row = 0
    for rid, n in zip(inputs.sample_seq_ids, inputs.sample_num_rows or [1] * len(inputs.sample_seq_ids)):
        if n == 1:
            plain.append((rid, row))
        else:
            _verify_one(out, rid, logits[row:row + n], states[rid], drafts[rid])
        row += n
    if plain:
        rows = torch.tensor([r for _, r in plain], device=logits.device)
        result = sampler.sample(logits[rows], [states[rid] for rid, _ in plain])
        for i, (rid, _) in enumerate(plain):
            if i in result.errors:
                out.failed[rid] = result.errors[i]
                continue
            out.tokens[rid] = [result.token_ids[i]]
            if result.logprobs[i] is not None:
                out.logprobs[rid] = [(result.logprobs[i], result.top_logprobs[i])]
    return out


def _verify_one(out: StepTokens, rid: str, logits: torch.Tensor, state: SamplingState, drafts: list[int]) -> None:
    try:
        v = verify(logits, state, drafts)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the batch
        out.failed[rid] = f"speculative verification failed: {type(exc).__name__}: {exc}"
        return
    out.tokens[rid] = v.token_ids
    out.drafts[rid] = (len(drafts), v.num_accepted)
    if v.logprobs and v.logprobs[0] is not None:
        out.logprobs[rid] = [(lp, top) for lp, top in zip(v.logprobs, v.top_logprobs)]
