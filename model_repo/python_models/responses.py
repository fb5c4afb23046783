"""Sending responses from a python-backend model (shared by the engine model and the router).

pb_utils only exists inside Triton's python-backend stub, so it is passed in rather than imported.
"""

from __future__ import annotations

from typing import Any


def try_send(sender: Any, response: Any, flags: int) -> bool:
    """Send; False when the client has gone away (Triton raises for a cancelled request)."""
    try:
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
        return True
    except Exception:  # noqa: BLE001 - pb_utils raises TritonModelException for closed streams
        return False


def error_response(pb_utils: Any, message: str, code: str = "INTERNAL") -> Any:
    """An error response; `code` names a pb_utils.TritonError code (INVALID_ARG, UNAVAILABLE, …)."""
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(error=error)
