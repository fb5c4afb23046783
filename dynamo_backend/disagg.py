"""Disaggregated prefill/decode through Dynamo: Dynamo routes, our KV connector moves the bytes.

    frontend ──request──▶ prefill worker (phase context)
                            prefill + first token; the KV is staged in our connector
                          ◀── last chunk: disaggregated_params = {"trtforge_kv_handle": KVHandle JSON}
    frontend ──request + prefill_result──▶ decode worker (phase generation)
                            check_handoff (HMAC with the shared handoff key, one use, limits),
                            import the KV (shared memory on one host, TCP/TLS across hosts),
                            stream the tokens from the first one on

Dynamo's frontend forwards the prefill worker's `disaggregated_params` to the decode worker
unchanged and streams only the decode worker's tokens to the client, so the decode worker sends
the first token (the handle carries it) before the ones it computes. What arrives in
`prefill_result` is not trusted: the handle is parsed and type-checked here, its prompt must be the
request's, and the connector's `check_handoff` refuses a forged, replayed or foreign one — that
request alone fails (InvalidArgument), the KV of others is never read.

A prefill that ends the request at its first token (EOS, a stop token) hands nothing over: the
params then say so (`trtforge_finished`: the token and the reason), and the decode worker returns
that token as the whole answer without touching its engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtforge.serving.kv_connector import HandoffError, KVHandle
from trtforge.serving.outputs import FinishReason, RequestOutput

HANDLE_KEY = "trtforge_kv_handle"
FINISHED_KEY = "trtforge_finished"
MODES = ("agg", "prefill", "decode")
"""Dynamo's --disaggregation-mode values a trtforge worker takes (agg: prefill and decode here)."""
_FINISHED_REASONS = ("stop", "length")


def handoff_params(output: RequestOutput) -> dict[str, Any]:
    """The prefill worker's disaggregated_params for its final output."""
    if output.finish_reason == FinishReason.HANDOFF and output.kv_handle is not None:
        return {HANDLE_KEY: output.kv_handle.to_json()}
    token = output.output_token_ids[-1] if output.output_token_ids else None
    return {FINISHED_KEY: {"token": token, "reason": str(output.finish_reason)}}


@dataclass(frozen=True)
class FinishedAtPrefill:
    """The prefill ended the request (no KV handed over): its one token and why."""

    token: int
    reason: str


def parse_prefill_result(request: dict[str, Any], prompt_token_ids: list[int],
                         vocab_size: int) -> KVHandle | FinishedAtPrefill:
    """The handoff a decode-bound request carries, type-checked (ValueError: this request fails).
    The handle's authenticity is the connector's check (LLMEngine.add_handoff)."""
    result = request.get("prefill_result")
    if not isinstance(result, dict):
        raise ValueError("a decode worker needs the prefill worker's result (prefill_result): route "
                         "through a frontend with a prefill worker")
    params = result.get("disaggregated_params")
    if not isinstance(params, dict) or (HANDLE_KEY in params) == (FINISHED_KEY in params):
        raise ValueError(f"prefill_result.disaggregated_params must hold {HANDLE_KEY!r} (from a "
                         "trtforge prefill worker)")
    if FINISHED_KEY in params:
        done = params[FINISHED_KEY]
        token = done.get("token") if isinstance(done, dict) else None
        reason = done.get("reason") if isinstance(done, dict) else None
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size \
                or reason not in _FINISHED_REASONS:
            raise ValueError(f"malformed {FINISHED_KEY}: {done!r}")
        return FinishedAtPrefill(token, reason)
    text = params[HANDLE_KEY]
    if not isinstance(text, str):
        raise ValueError(f"{HANDLE_KEY} must be a string (the handle's JSON)")
    try:
        handle = KVHandle.from_json(text)
    except HandoffError as exc:
        raise ValueError(str(exc)) from None
    if list(handle.prompt_token_ids) != list(prompt_token_ids):
        raise ValueError("the handed-over KV is of another prompt than this request's")
    return handle
