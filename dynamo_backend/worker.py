"""TrtforgeEngine: a trtforge engine directory behind Dynamo's `LLMEngine` interface.

    start()     loads the engine (RuntimeConfig as everywhere), writes the frontend's model card,
                starts the engine loop, and registers what the router needs: context length, KV
                block size, total blocks, max sequences and batched tokens
    generate()  token ids in (the frontend tokenized), token ids out as the engine makes them;
                the last chunk has finish_reason and usage; a bad request raises InvalidArgument
                (that request alone), a full queue is refused the same way
    abort()     the client went away: the engine aborts the request and frees its KV blocks
    kv_event_sources() / attach_snapshot_publisher()
                the prefix cache's stored/removed blocks and the load, for the KV-aware router
                (publish.py)
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from typing import Any

from dynamo.common.backend import LLMEngine
from dynamo.common.backend.engine import EngineConfig, LlmRegistration
from dynamo.common.backend.publisher import PushSource
from dynamo.llm.exceptions import InvalidArgument, Unknown

from trtforge.config.runtime import Phase
from trtforge.dynamo_backend.disagg import MODES, FinishedAtPrefill, handoff_params, parse_prefill_result
from trtforge.dynamo_backend.engine_loop import EngineLoop
from trtforge.dynamo_backend.model_card import write_model_card
from trtforge.dynamo_backend.options import WorkerOptions
from trtforge.dynamo_backend.publish import RouterFeed
from trtforge.dynamo_backend.requests import prompt_token_ids, sampling_params
from trtforge.serving.core.scheduler import EngineOverloaded
from trtforge.serving.engine import LLMEngine as TrtforgeLLMEngine
from trtforge.serving.outputs import FinishReason, RequestOutput

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled",
           FinishReason.TIMEOUT: "length", FinishReason.HANDOFF: "length"}
"""Our finish reasons in Dynamo's words (a timeout ends the answer where it is, as max_tokens does;
a prefill worker's handoff ends its part as max_tokens=1 would)."""
_PHASES = {"agg": Phase.BOTH, "prefill": Phase.CONTEXT, "decode": Phase.GENERATION}


def _dynamo_mode(name: str) -> Any:
    """Dynamo's DisaggregationMode of a --disaggregation-mode value."""
    from dynamo.common.constants import DisaggregationMode

    return {"agg": DisaggregationMode.AGGREGATED, "prefill": DisaggregationMode.PREFILL,
            "decode": DisaggregationMode.DECODE}[name]


class TrtforgeEngine(LLMEngine):
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.engine: TrtforgeLLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.feed: RouterFeed | None = None
        self.card: Path | None = None
        self._max_seq_len = 0

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        raise NotImplementedError("start trtforge's worker with `trtforge dynamo-worker ENGINE_DIR`")

    def worker_config(self) -> Any:
        """Dynamo's WorkerConfig for these options (the model card must be written first)."""
        from dynamo.common.backend import WorkerConfig

        o = self.options
        return WorkerConfig(namespace=o.namespace, component=o.component, endpoint=o.endpoint,
                            model_name=str(self.card), served_model_name=self.served_name,
                            discovery_backend=o.discovery_backend, request_plane=o.request_plane,
                            event_plane=o.event_plane, enable_kv_routing=o.enable_kv_routing,
                            disaggregation_mode=_dynamo_mode(o.disaggregation_mode))

    @property
    def served_name(self) -> str:
        return self.options.served_model_name or Path(self.options.engine_dir).resolve().name

    def load(self) -> None:
        """Load the engine and write the model card (before the Dynamo worker starts)."""
        mode = self.options.disaggregation_mode
        if mode not in MODES:
            raise ValueError(f"--disaggregation-mode {mode!r}: one of {', '.join(MODES)}")
        runtime = self.options.runtime
        if runtime.phase not in (Phase.BOTH, _PHASES[mode]):
            raise ValueError(f"phase {runtime.phase} contradicts --disaggregation-mode {mode}")
        runtime = dataclasses.replace(runtime, phase=_PHASES[mode])
        engine = TrtforgeLLMEngine.from_engine_dir(self.options.engine_dir, runtime, **self.options.scheduler)
        self.engine = engine
        self._max_seq_len = engine.scheduler_config.max_seq_len
        self.card = write_model_card(Path(self.options.engine_dir), engine.engine_config, self._max_seq_len,
                                     self.options.model_card_dir and Path(self.options.model_card_dir))
        log = engine.scheduler.kv_manager.enable_events()
        self.feed = RouterFeed(log, engine.scheduler_config.block_size)
        self.loop = EngineLoop(engine, after_step=lambda: self.feed.publish(engine.stats))

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        if self.engine is None:
            self.load()
        sc = self.engine.scheduler_config
        return EngineConfig(model=str(self.card), served_model_name=self.served_name, llm=LlmRegistration(
            context_length=sc.max_seq_len, kv_cache_block_size=sc.block_size, total_kv_blocks=sc.num_blocks,
            max_num_seqs=sc.max_batch_size, max_num_batched_tokens=sc.max_num_tokens))

    async def kv_event_sources(self) -> list:
        def ready(publisher: Any) -> None:
            self.feed.kv_publisher = publisher

        return [PushSource(on_ready=ready, dp_rank=0)]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self.feed.snapshot_publisher = publisher

    async def generate(self, request: dict[str, Any], context: Any):
        handoff = None
        if self.options.disaggregation_mode == "prefill":
            # Dynamo sends prefill workers max_tokens=1; ours must not end the request at its first
            # token but hand it over (the decode worker applies the client's max_tokens).
            request = {**request, "stop_conditions": {**(request.get("stop_conditions") or {}), "max_tokens": None}}
        try:
            ids = prompt_token_ids(request)
            params = sampling_params(request, default_max_tokens=max(1, self._max_seq_len - len(ids)))
            if self.options.disaggregation_mode == "decode":
                handoff = parse_prefill_result(request, ids, self.engine.engine_config.model.vocab_size)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(str(exc)) from None
        if isinstance(handoff, FinishedAtPrefill):  # the prefill ended it: its one token is the answer
            yield {"token_ids": [handoff.token], "index": 0, "finish_reason": handoff.reason,
                   "completion_usage": {"prompt_tokens": len(ids), "completion_tokens": 1,
                                        "total_tokens": len(ids) + 1}}
            return
        # Dynamo streams the decode worker's tokens only: the first one (the handle's) goes first.
        lead = ([int(handoff.first_token)], [handoff.cum_logprob]) if handoff is not None else ([], [])
        prefill = self.options.disaggregation_mode == "prefill"
        rid = _request_id(context)
        outputs = self.loop.submit(rid, ids, params, handoff)
        finished = False
        try:
            while not finished:
                item = _checked(await outputs.get())
                finished = item.finished
                yield _chunk(item, *lead, prefill=prefill)
                lead = ([], [])
        finally:
            if not finished:  # cancelled (the client left, or a stop string ended it upstream)
                self.loop.cancel(rid)

    async def abort(self, context: Any) -> None:
        if self.loop is not None:
            self.loop.cancel(_request_id(context))

    async def cleanup(self) -> None:
        if self.loop is not None:
            await asyncio.to_thread(self.loop.close)
            self.loop = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _checked(item: RequestOutput | BaseException) -> RequestOutput:
    """An output of the engine loop, or the Dynamo error that fails this request."""
    if isinstance(item, EngineOverloaded):
        raise InvalidArgument(f"the worker's queue is full, retry later: {item}")
    if isinstance(item, ValueError):
        raise InvalidArgument(str(item))
    if isinstance(item, BaseException):
        raise Unknown(str(item))
    if item.finished and item.finish_reason == FinishReason.ERROR:
        raise Unknown(item.error or "the request failed")
    return item


def _chunk(item: RequestOutput, lead_ids: list[int], lead_logprobs: list[float], prefill: bool) -> dict[str, Any]:
    """Dynamo's chunk for one output (`lead_*`: a handed-over first token sent before it; the
    last chunk has the finish reason, the usage and, from a prefill worker, the handoff)."""
    chunk: dict[str, Any] = {"token_ids": lead_ids + list(item.new_token_ids), "index": 0}
    if item.logprobs is not None:
        chunk["log_probs"] = lead_logprobs[:len(lead_ids)] + list(item.logprobs)
    if item.finished:
        chunk["finish_reason"] = _FINISH.get(item.finish_reason, "stop")
        if prefill:
            chunk["disaggregated_params"] = handoff_params(item)
        n = len(item.output_token_ids)
        chunk["completion_usage"] = {
            "prompt_tokens": item.num_prompt_tokens, "completion_tokens": n,
            "total_tokens": item.num_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": item.num_cached_tokens}}
    return chunk


def _request_id(context: Any) -> str:
    """The request's id: Dynamo's context id (unique per request), so abort() can name it."""
    try:
        rid = context.id()
    except Exception:  # noqa: BLE001 - no id from this context: one of our own
        rid = None
    return str(rid) if rid else uuid.uuid4().hex
