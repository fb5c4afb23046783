"""The part of TritonBridge's interface every front-end unit test's stand-in shares: these tests
check the HTTP layer (schemas, mapping, errors); the real bridge and a real tritonserver are
tests/e2e/test_openai*.py's. Subclasses define `generate(arrays)`."""

from __future__ import annotations


class StubBridge:
    def __init__(self, url: str, model: str) -> None:
        self.url = url

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        return True
