"""What every request meets before the API: an id, the API key, the body-size cap, and a net
for unexpected exceptions (a generic 500; what was raised goes to the log).

`Guard` is a plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would run the app
in another task and hide the client's disconnect from the endpoints). For each HTTP request it

1. sets the request id (errors.REQUEST_ID; the `X-Request-Id` header of the answer),
2. with API keys, answers 401 unless `Authorization: Bearer KEY` is sent with one of them (every
   path but /health: liveness probes carry no key), before the body is parsed or kept; with
   `api_key_cache_salt`, records the key's prefix-cache salt in the scope (TENANT_SALT),
3. reads the body, keeping at most `max_request_bytes` of it, answering 413 beyond it, then
   hands the body to the app (JSON is parsed only after this),
4. answers an exception the app did not handle with a generic 500 naming the request id.

Before a 401 or 413 the rest of the body is read and dropped, up to twice `max_request_bytes`:
uvicorn closes a connection whose request was not read to its end when the client asked for
`Connection: close` (urllib does), and a client still sending would see the connection reset
instead of the answer. A body declared larger than twice the cap is answered at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from trtforge.frontend.errors import (
    APIError,
    body_too_large,
    internal_error_response,
    log,
    new_request_id,
    unauthorized,
)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

API_KEY_ENV = "TRTFORGE_API_KEY"
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the API key."""
PROMPT_CHARS_PER_TOKEN = 16
"""Default prompt cap: characters per token of max_seq_len. Text averages 3-5 characters a
token, so a prompt over the cap could not fit the engine anyway, short of pathological text."""
BODY_BYTES_PER_PROMPT_CHAR = 6
"""Default body cap: bytes per prompt character (a JSON \\uXXXX escape is 6 bytes)."""
MIN_REQUEST_BYTES = 1 << 20
TOKENIZER_THREADS = 4
"""Threads that run chat templates and token counts, off the event loop."""
TENANT_SALT = "trtforge.tenant_cache_salt"
"""Scope key: the prefix-cache salt of the request's API key (with api_key_cache_salt)."""


@dataclass(frozen=True)
class Limits:
    """The front end's own protections (`trtforge serve --api-key/--max-request-bytes/...`)."""

    api_key: str | None = None
    """Required as `Authorization: Bearer KEY` on every route but /health; None: open."""
    api_keys: tuple[str, ...] = ()
    """More keys accepted beside `api_key` (one per tenant, say), each checked like it."""
    api_key_cache_salt: bool = False
    """Give every API key its own prefix-cache namespace: requests made with different keys never
    share cached prompt blocks, so no key's holder can tell from time-to-first-token (or the
    prefix-cache counters) whether another key's holder sent a prefix. A request's own
    `cache_salt` then divides its key's namespace further; it cannot leave it. Needs a key."""
    max_request_bytes: int | None = None
    """Largest request body read (413 beyond). None: BODY_BYTES_PER_PROMPT_CHAR per prompt
    character, at least MIN_REQUEST_BYTES."""
    max_prompt_chars: int | None = None
    """Most characters of prompt text (prompt or message texts and names, plus stop strings),
    checked before any tokenizing (400 beyond). None: PROMPT_CHARS_PER_TOKEN × max_seq_len."""
    tokenizer_threads: int = TOKENIZER_THREADS

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_chars", "tokenizer_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if not isinstance(self.api_keys, tuple) or not all(
                isinstance(k, str) and k.strip() for k in self.api_keys):
            raise ValueError("api_keys must be a tuple of non-empty keys")
        if self.api_key_cache_salt and not self.keys():
            raise ValueError("api_key_cache_salt gives each API key its own prefix-cache salt: "
                             "give the server API keys too")

    def keys(self) -> tuple[str, ...]:
        """Every key accepted (none: the API is open)."""
        return ((self.api_key,) if self.api_key else ()) + self.api_keys

    def resolved(self, max_seq_len: int) -> "Limits":
        """These limits with the defaults filled in for an engine of `max_seq_len`."""
        prompt = self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_seq_len
        body = self.max_request_bytes or max(MIN_REQUEST_BYTES, BODY_BYTES_PER_PROMPT_CHAR * prompt)
        return replace(self, max_prompt_chars=prompt, max_request_bytes=body)


def _digest(secret: bytes) -> bytes:
    # Compared as digests: equal lengths, so the comparison does not reveal the key's length.
    return hashlib.sha256(secret).digest()


def request_cache_salt(tenant: str | None, own: str | None) -> str | None:
    """The salt a request is sent with: its own `cache_salt`, under its API key's salt when keys
    are salted (the key's salt has a fixed length, so no client salt reaches another key's)."""
    if tenant is None:
        return own
    return tenant if own is None else f"{tenant}:{own}"


class _ClientLeft(Exception):
    pass


class Guard:
    """The ASGI middleware described above; `limits` must be resolved."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits: Limits) -> None:
        assert limits.max_request_bytes is not None
        self.app = app
        self.max_bytes = limits.max_request_bytes
        self._keys = [_digest(key.encode("utf-8")) for key in limits.keys()]
        # A key's salt: an HMAC of its digest under a secret of this process, so the salt that
        # travels to Triton (and may be logged there) tells nothing about the key.
        self._salt_secret = secrets.token_bytes(32) if limits.api_key_cache_salt else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        request_id = new_request_id().encode("ascii")
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id)]}
            await send(message)

        try:
            refusal, body, ended = self._refusal(scope), b"", False
            if refusal is None:
                body, ended = await self._body(receive)
                if body is None:
                    refusal = body_too_large(self.max_bytes)
            if refusal is not None:
                if not ended and _declared_length(scope) <= 2 * self.max_bytes:
                    await _drain(receive, 2 * self.max_bytes)
                await refusal.response()(scope, receive, send_with_id)
                return
            await self.app(scope, _replay(body, receive), send_with_id)
        except _ClientLeft:
            return
        except Exception:
            log.exception("request %s: unexpected error", request_id.decode())
            if started:  # too late for a status: uvicorn closes the connection
                raise
            await internal_error_response()(scope, receive, send_with_id)

    def _refusal(self, scope: Scope) -> APIError | None:
        """401 or 413 from the headers alone, before reading the body."""
        headers = dict(scope["headers"])  # lower-case names; the last of repeated ones wins
        if self._keys and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            given, matched = _digest(token.strip()), None
            for key in self._keys:  # every key compared, so the time does not tell which matched
                if hmac.compare_digest(given, key):
                    matched = key
            if scheme.lower() != b"bearer" or matched is None:
                return unauthorized()
            if self._salt_secret is not None:
                salt = hmac.new(self._salt_secret, matched, hashlib.sha256).hexdigest()[:32]
                scope[TENANT_SALT] = f"key-{salt}"
        if _declared_length(scope) > self.max_bytes:
            return body_too_large(self.max_bytes)
        return None

    async def _body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """(the whole body, or None once it exceeds the cap; whether it was read to its end)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                raise _ClientLeft()
            chunk = message.get("body", b"")
            size += len(chunk)
            ended = not message.get("more_body", False)
            if size > self.max_bytes:
                return None, ended
            chunks.append(chunk)
            if ended:
                return b"".join(chunks), True


def _declared_length(scope: Scope) -> int:
    """The Content-Length header's value; 0 without one (chunked, or no body)."""
    length = dict(scope["headers"]).get(b"content-length", b"")
    return int(length) if length.isdigit() else 0


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of the body, up to `budget` bytes."""
    while budget >= 0:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body read, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
