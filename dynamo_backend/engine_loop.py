"""The engine's loop on its own thread, fed by asyncio coroutines (Dynamo calls generate() on its
event loop, concurrently for every request in flight).

    asyncio side                              engine thread
    submit(ids, params) ──inbox──▶  add_request … step() → outputs ──call_soon_threadsafe──▶ queue
    cancel(rid)         ──inbox──▶  abort(rid): its blocks are freed, its final output delivered

The inbox is drained between steps, so the engine is touched by one thread only. A request the
engine refuses (ValueError: too long, bad parameters; EngineOverloaded: the queue is full) gets
that exception on its own queue. Should a step raise (a bug, never a request's fault: the engine
isolates a bad request itself), the requests in that step fail with the reason and the loop goes
on serving. `after_step` runs on the engine thread after every step (KV events, load).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.kv_connector import KVHandle
from trtforge.serving.outputs import RequestOutput


class EngineLoop:
    def __init__(self, engine: LLMEngine, after_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._after_step = after_step or (lambda: None)
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._deliver: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtforge-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               handle: KVHandle | None = None) -> asyncio.Queue:
        """Queue a request (`handle`: a generation-phase engine continues that handoff instead);
        its outputs (RequestOutput, the last one finished) or the exception that refused it
        arrive on the returned queue, in the caller's event loop."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._inbox.put(("add", request_id, prompt_token_ids, params, deliver, handle))
        return outputs

    def cancel(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed at the next iteration); no-op once finished."""
        self._inbox.put(("abort", request_id))

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=timeout_s)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                self.engine.poll()  # a disaggregated phase's connector: free handoffs taken or expired
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                self._fail_all(RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}"))
                continue
            for out in outputs:
                deliver = self._deliver.get(out.request_id)
                if deliver is not None:
                    deliver(out)
                    if out.finished:
                        del self._deliver[out.request_id]
            self._after_step()
        self._fail_all(RuntimeError("the worker is shutting down"))

    def _take(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self._after_step()  # idle: still publish (e.g. the load going to 0)
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple[Any, ...]) -> None:
        if item[0] == "add":
            _, rid, ids, params, deliver, handle = item
            try:
                if handle is not None:
                    self.engine.add_handoff(handle, params, request_id=rid)
                else:
                    self.engine.add_request(ids, params, request_id=rid)
            except Exception as exc:  # noqa: BLE001 - ValueError / EngineOverloaded / HandoffError: this request only
                deliver(exc)
                return
            self._deliver[rid] = deliver
        elif item[0] == "abort":
            self.engine.abort(item[1])

    def _fail_all(self, exc: BaseException) -> None:
        for rid, deliver in list(self._deliver.items()):
            try:
                self.engine.abort(rid, error=str(exc))  # frees its blocks
            except Exception:  # noqa: BLE001 - the engine is already in trouble: answer anyway
                pass
            deliver(exc)
        self._deliver.clear()
