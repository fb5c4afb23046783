"""The engine: one schedule → execute → update loop, used by the CLI, the Triton
adapter and the benchmarks alike.

    add_request ──▶ Scheduler (ids, counts, block tables; no tensors)
                        │ schedule(): decodes first, then prefill chunks, within the token budget
                        ▼
                    prepare_inputs ──▶ Executor (torch network | TensorRT) ──▶ logits
                        │
                    Sampler ──▶ Scheduler.update ──▶ detokenize + stop check ──▶ RequestOutput
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from trtforge.config.fields import parse_bytes
from trtforge.models.engine_dir import EngineConfig, read_engine_config
from trtforge.models.loader import load_tokenizer
from trtforge.models.kv_sizing import kv_num_blocks

from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.worker.cuda_graphs import DEFAULT_BATCH_SIZES
from trtforge.serving.detokenizer import IncrementalDetokenizer
from trtforge.serving.worker.executor import Executor, make_executor
from trtforge.serving.worker.model_inputs import prepare_inputs
from trtforge.serving.outputs import RequestMetrics, RequestOutput
from trtforge.serving.sampler import Sampler, SamplingState
from trtforge.config.sampling import SamplingParams
from trtforge.serving.core.scheduler import EngineOverloaded, Scheduler, SchedulerOutput
from trtforge.serving.core.sequence import Sequence, SequenceStatus
from trtforge.serving.stop_checker import StopChecker

_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH,
           "abort": SequenceStatus.FINISHED_ABORTED, "error": SequenceStatus.FINISHED_ABORTED,
           "timeout": SequenceStatus.FINISHED_ABORTED, "handoff": SequenceStatus.FINISHED_STOPPED}

PHASES = ("both", "context", "generation")
"""both: prefill and decode here (co-located). context: prefill and the first token, then hand the
KV over (RequestOutput.kv_handle). generation: continue from handed-over KV (add_handoff)."""


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and running totals (what the metrics export)."""

    kv_blocks_used: int
    """KV blocks held by requests."""
    kv_blocks_total: int
    """KV blocks in the pool."""
    num_running: int
    """Requests admitted and holding KV blocks."""
    num_waiting: int
    """Requests queued for admission (new or preempted)."""
    prompt_tokens_total: int
    """Prompt tokens of every request added since start."""
    generation_tokens_total: int
    """Tokens generated since start."""
    num_preemptions: int
    """Preemptions since start (the scheduler's count)."""
    prefix_cache_queried_tokens: int
    """Tokens looked up in the prefix cache since start, at each admission (or resume)."""
    prefix_cache_hit_tokens: int
    """Of those, tokens whose KV was reused from the prefix cache (not recomputed)."""
    requests_refused_total: int = 0
    """Requests refused since start because the waiting queue was full (EngineOverloaded)."""
    requests_timed_out_total: int = 0
    """Requests aborted since start because they passed their deadline (timeout_s)."""
    kv_handoffs_total: int = 0
    """Disaggregated serving: KV handoffs completed (context: taken by a generation side;
    generation: imported)."""
    kv_handoff_bytes_total: int = 0
    """Bytes of K/V copied for handoffs (context: into the shared segment; generation: out of it)."""
    kv_handoff_seconds_total: float = 0.0
    """Time spent on those copies."""
    kv_handoffs_expired_total: int = 0
    """Context: handoffs freed because no generation side took them before their deadline."""
    kv_handoff_blocks_held: int = 0
    """Context: staging blocks held by handoffs not yet taken."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start (0 before any lookup)."""
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0


@dataclass
class _Request:
    """Engine-side state of one request; the scheduler owns its Sequence, under the same id."""

    request_id: str
    num_prompt_tokens: int
    sampling: SamplingState
    """Its output_token_ids are the engine's own list, appended when a token is sampled."""
    detok: IncrementalDetokenizer
    stop: StopChecker
    metrics: RequestMetrics
    text: str = ""
    cum_logprob: float = 0.0
    kv_handle: Any = None
    """Generation phase: the handoff whose KV this request waits for (None once imported)."""


def num_kv_blocks(cfg: EngineConfig, kv_cache_memory: str | int | None) -> int:
    """Blocks the KV budget buys (engine.json's budget unless overridden), at least one."""
    budget = parse_bytes(kv_cache_memory if kv_cache_memory is not None else cfg.build["kv_cache_memory"])
    return max(1, kv_num_blocks(cfg.model, cfg.dtype, cfg.block_size, budget, cfg.kv_cache_dtype))


class LLMEngine:
    def __init__(self, cfg: EngineConfig, executor: Executor, tokenizer: Any, sched: SchedulerConfig,
                 phase: str = "both", handoff_timeout_s: float = 30.0, kv_connector: str = "shm",
                 kv_advertise_host: str | None = None):
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} is invalid: must be one of {', '.join(PHASES)}")
        self.phase = phase
        self.kv_exporter = self.kv_importer = None
        if phase != "both" and not hasattr(executor, "kv_caches"):
            raise ValueError(f"phase={phase} (disaggregated serving) hands over the KV pools of this "
                             "process; a tensor-parallel engine (tp_size > 1) keeps them in its ranks: "
                             "not supported yet, serve it co-located")
        if phase == "context":
            from trtforge.serving.kv_connector import make_exporter

            self.kv_exporter = make_exporter(kv_connector, _kv_tensors(executor), sched.num_blocks,
                                             sched.block_size, handoff_timeout_s, kv_advertise_host)
        elif phase == "generation":
            from trtforge.serving.kv_connector import KVImporter

            self.kv_importer = KVImporter()
        self.engine_config = cfg
        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler_config = sched
        self.scheduler = Scheduler(sched)
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}  # by request id, which is also the seq_id
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()  # request ids for callers who give none
        self._eos = tuple(cfg.model.eos_token_ids)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_refused_total = 0
        self.requests_timed_out_total = 0
        self._deadlines: dict[str, float] = {}  # request id -> monotonic time it times out

    @classmethod
    def from_engine_dir(cls, path: str | Path, device: str | torch.device = "cpu",
                        kv_cache_memory: str | int | None = None, verify_checksums: bool = True,
                        cuda_graphs: bool = False, phase: str = "both", handoff_timeout_s: float = 30.0,
                        kv_connector: str = "shm", kv_advertise_host: str | None = None,
                        **scheduler_overrides: Any) -> "LLMEngine":
        """Load an engine directory; scheduler parameters default to engine.json's and can be overridden.
        cuda_graphs: replay decode steps from CUDA graphs captured for batch sizes 1, 2, 4, … up to
        max_batch_size (device cuda only). phase: see PHASES (disaggregated serving); a context
        engine hands its KV over through `kv_connector`: shm (one host) or tcp://HOST:PORT (listen
        there; other hosts reach it at kv_advertise_host, default this host's name)."""
        cfg = read_engine_config(path, verify_checksums=verify_checksums)
        blocks = num_kv_blocks(cfg, kv_cache_memory)
        sched = SchedulerConfig.for_engine(cfg.build, cfg.scheduling, blocks, scheduler_overrides)
        sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b < sched.max_batch_size) + (sched.max_batch_size,)
        executor = make_executor(str(path), cfg, blocks, device, sizes if cuda_graphs else ())
        return cls(cfg, executor, load_tokenizer(path), sched, phase, handoff_timeout_s, kv_connector,
                   kv_advertise_host)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; raises ValueError with a clear message for a bad one (prompt +
        max_tokens beyond max_seq_len included), EngineOverloaded when the waiting queue is full
        (max_queue_size / max_queued_tokens: retry later)."""
        params = (params or SamplingParams()).validate()
        if params.bad_words:
            params = params.resolve_bad_words(self.tokenizer)
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        arrival = arrival_time or time.monotonic()
        max_tokens = params.max_tokens
        if self.phase == "context":  # computes the prompt and one token; the rest is elsewhere
            limit = self.scheduler_config.max_seq_len
            if len(ids) < limit and len(ids) + max_tokens > limit:
                raise ValueError(f"request {rid}: prompt of {len(ids)} tokens + max_tokens="
                                 f"{max_tokens} exceeds max_seq_len={limit}; send max_tokens <= "
                                 f"{limit - len(ids)} for this prompt, or shorten the prompt")
            max_tokens = 1
        # The scheduler's Sequence gets its own copy of the prompt: nothing it holds is shared.
        seq = Sequence(seq_id=rid, prompt_token_ids=list(ids), max_tokens=max_tokens,
                       arrival_time=arrival)
        try:
            self.scheduler.add(seq)  # validates length and KV need, bounds the waiting queue
        except EngineOverloaded:
            self.requests_refused_total += 1
            raise
        state = SamplingState(params=params, prompt_token_ids=ids, eos_token_ids=self._eos)
        req = _Request(rid, len(ids), state,
                       IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                       StopChecker(self.scheduler_config.max_seq_len), RequestMetrics(arrival))
        self._requests[rid] = req
        if params.timeout_s is not None:
            self._deadlines[rid] = arrival + params.timeout_s
        self.prompt_tokens_total += len(ids)
        return rid

    def add_handoff(self, handle: Any, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Generation phase: continue a request whose prompt KV and first token a context engine
        computed (`handle`: its KVHandle). The KV is copied in when the request is admitted; the
        first token's text is not sent again. Errors as add_request; the handle is released on
        any error (the context side frees its blocks)."""
        if self.kv_importer is None:
            raise ValueError(f"add_handoff needs an engine in the generation phase (this one: {self.phase})")
        try:
            params = (params or SamplingParams()).validate()
            if params.bad_words:
                params = params.resolve_bad_words(self.tokenizer)
            ids = self._encode(list(handle.prompt_token_ids))
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
            if handle.block_size != self.scheduler_config.block_size or handle.num_tokens != len(ids):
                raise ValueError(f"the handoff of {handle.request_id} does not fit this engine "
                                 f"(block size {handle.block_size} vs {self.scheduler_config.block_size})")
            first = int(handle.first_token)
            arrival = arrival_time or time.monotonic()
            seq = Sequence(seq_id=rid, prompt_token_ids=list(ids), max_tokens=params.max_tokens,
                           output_token_ids=[first], arrival_time=arrival,
                           num_external_tokens=len(ids))
            self.scheduler.add(seq)
        except BaseException:
            self.kv_importer.release(handle)
            raise
        state = SamplingState(params=params, prompt_token_ids=ids, eos_token_ids=self._eos,
                              seed=handle.seed)
        state.restore_generator(handle.generator_state)
        state.output_token_ids.append(first)
        req = _Request(rid, len(ids), state,
                       IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                       StopChecker(self.scheduler_config.max_seq_len), RequestMetrics(arrival),
                       cum_logprob=handle.cum_logprob, kv_handle=handle)
        # Replay the first token (its text went out from the context side) so the detokenizer and
        # the stop checker hold exactly the state they would hold co-located.
        _, req.text = req.stop.check(state, first, req.detok.step([first]))
        self._requests[rid] = req
        if params.timeout_s is not None:
            self._deadlines[rid] = arrival + params.timeout_s
        return rid

    def poll(self) -> None:
        """Housekeeping between steps when idle: free handoffs taken or past their deadline."""
        if self.kv_exporter is not None:
            self.kv_exporter.poll()

    def close(self) -> None:
        """Release what outlives the process otherwise (the context phase's shared segment)."""
        if self.kv_exporter is not None:
            self.kv_exporter.close()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.engine_config.model.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        return ids

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """Cancel a request and free its KV blocks; its final output comes with the next step()."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(request_id, _STATUS[reason])
        self._pending.append(self._finish(req, reason, [], "", error=error))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule → execute → update. Returns this step's outputs."""
        self._expire_deadlines()  # before schedule(): a timed-out request is never scheduled
        self.poll()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.kv_imports:
            self._import_kv(sched)
        if sched.is_empty:
            return outputs + self._drain_pending()
        now = time.monotonic()
        for chunk in sched.chunks:
            m = self._requests[chunk.seq_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        try:
            sampled, logprobs = self._execute(sched)
        except Exception as exc:  # a failing batch fails its requests, never the engine
            for chunk in sched.chunks:
                if chunk.seq_id in self._requests:
                    self.abort(chunk.seq_id, "error", f"{type(exc).__name__}: {exc}")
            return outputs + self._drain_pending()
        self.scheduler.update(sched, sampled)
        done = time.monotonic()
        for rid, token in sampled.items():
            outputs.append(self._on_token(self._requests[rid], token, logprobs.get(rid), done))
        return outputs

    def _expire_deadlines(self) -> None:
        """Abort the requests past their deadline, waiting or running, freeing their KV blocks."""
        if not self._deadlines:
            return
        now = time.monotonic()
        for rid in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            req = self._requests[rid]
            self.requests_timed_out_total += 1
            self.abort(rid, "timeout", f"deadline exceeded: timeout_s={req.sampling.params.timeout_s:g} "
                                       f"passed after {len(req.sampling.output_token_ids)} generated "
                                       "tokens; the request was aborted (send a longer timeout_s "
                                       "or a smaller max_tokens)")

    def _import_kv(self, sched: SchedulerOutput) -> None:
        """Copy handed-over KV into the blocks the scheduler gave it; a failed import fails that
        request alone (its chunk leaves the batch)."""
        failed = set()
        for imp in sched.kv_imports:
            req = self._requests.get(imp.seq_id)
            if req is None or req.kv_handle is None:
                continue
            handle, req.kv_handle = req.kv_handle, None
            try:
                self.kv_importer.import_into(handle, _kv_tensors(self.executor), imp.block_table)
            except Exception as exc:  # noqa: BLE001 - expired handle, owner gone: this request only
                failed.add(imp.seq_id)
                self.abort(imp.seq_id, "error", f"KV handoff failed: {exc}")
        if failed:
            sched.chunks = [c for c in sched.chunks if c.seq_id not in failed]

    def _drain_pending(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def _execute(self, sched: SchedulerOutput) -> tuple[dict[int, int], dict[int, Any]]:
        inputs = prepare_inputs(sched, self.scheduler_config.block_size, self.executor.device)
        logits = self.executor.execute(inputs)  # always: a non-sampling prefill chunk still writes KV
        if not inputs.sample_seq_ids:
            return {}, {}
        states = [self._requests[i].sampling for i in inputs.sample_seq_ids]
        result = self.sampler.sample(logits, states)
        sampled = dict(zip(inputs.sample_seq_ids, result.token_ids))
        logprobs = {i: (lp, top) for i, lp, top in zip(inputs.sample_seq_ids, result.logprobs,
                                                         result.top_logprobs) if lp is not None}
        return sampled, logprobs

    def _on_token(self, req: _Request, token: int, logprob: Any, now: float) -> RequestOutput:
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.token_times.append(now)
        req.sampling.output_token_ids.append(token)  # the engine's copy; the scheduler keeps its own
        self.generation_tokens_total += 1
        if logprob is not None:
            req.cum_logprob += logprob[0]
        delta = req.detok.step([token])
        reason, text = req.stop.check(req.sampling, token, delta)
        lp = ([logprob[0]], [logprob[1]]) if logprob is not None else (None, None)
        if reason is None and self.kv_exporter is not None:
            return self._handoff(req, token, text, lp)
        if reason is None:
            req.text += text
            return RequestOutput(req.request_id, [token], text, list(req.sampling.output_token_ids),
                                 req.text, False, None, req.num_prompt_tokens, m, lp[0], lp[1],
                                 req.cum_logprob if logprob is not None else None)
        if not isinstance(req.stop.stop_reason, str):  # not cut at a stop string: flush the tail
            text += req.stop.release(req.detok.flush())
        self.scheduler.finish(req.request_id, _STATUS[reason])
        out = self._finish(req, reason, [token], text)
        out.logprobs, out.top_logprobs = lp
        return out

    def _handoff(self, req: _Request, token: int, text: str, lp: tuple) -> RequestOutput:
        """Context phase: the prompt is computed and the first token sampled; export the KV and
        end the request here (its pool blocks are freed; the copy waits in the connector)."""
        blocks, computed = self.scheduler.kv_blocks(req.request_id)
        state = req.sampling
        try:
            handle = self.kv_exporter.export(
                req.request_id, blocks[:-(-computed // self.scheduler_config.block_size)], computed,
                prompt_token_ids=list(state.prompt_token_ids), first_token=token, seed=state.seed,
                generator_state=state.generator_state(), cum_logprob=req.cum_logprob)
        except Exception as exc:  # noqa: BLE001 - a full handoff area fails this request only
            self.scheduler.finish(req.request_id, _STATUS["error"])
            return self._finish(req, "error", [], "", error=f"KV handoff failed: {exc}")
        self.scheduler.finish(req.request_id, _STATUS["handoff"])
        out = self._finish(req, "handoff", [token], text)
        out.logprobs, out.top_logprobs = lp
        out.kv_handle = handle
        return out

    def _finish(self, req: _Request, reason: str, new_ids: list[int], text: str,
                error: str | None = None) -> RequestOutput:
        if req.kv_handle is not None:  # ended before its handed-over KV was taken
            self.kv_importer.release(req.kv_handle)
            req.kv_handle = None
        req.metrics.finished_time = time.monotonic()
        req.text += text
        del self._requests[req.request_id]
        self._deadlines.pop(req.request_id, None)
        return RequestOutput(req.request_id, new_ids, text, list(req.sampling.output_token_ids),
                             req.text, True, reason, req.num_prompt_tokens, req.metrics,
                             cum_logprob=req.cum_logprob if req.sampling.params.logprobs is not None else None,
                             error=error, stop_reason=req.stop.stop_reason)

    # ---- conveniences -----------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts together to completion; final outputs in input order (with the logprobs of
        all output tokens when requested)."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                rids.append(self.add_request(p, sp))
        except (ValueError, EngineOverloaded):  # withdraw the ones already queued, then report
            for rid in rids:
                self.abort(rid)
            self._pending.clear()
            raise
        final: dict[str, RequestOutput] = {}
        lps: dict[str, list[float]] = {r: [] for r in rids}
        tops: dict[str, list[Any]] = {r: [] for r in rids}
        while len(final) < len(rids):
            for out in self.step():
                if out.logprobs is not None and out.request_id in lps:
                    lps[out.request_id] += out.logprobs
                    tops[out.request_id] += out.top_logprobs or []
                if out.finished:
                    if lps.get(out.request_id):  # the final output carries every token's logprobs
                        out.logprobs, out.top_logprobs = lps[out.request_id], tops[out.request_id]
                    final[out.request_id] = out
        return [final[r] for r in rids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Stream one request's outputs (steps the engine; other requests advance too)."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.scheduler.kv_manager
        stats = EngineStats(kv.num_used_blocks, kv.num_blocks, sched.num_running, sched.num_waiting,
                            self.prompt_tokens_total, self.generation_tokens_total,
                            sched.num_preemptions, kv.num_queried_tokens, kv.num_hit_tokens,
                            self.requests_refused_total, self.requests_timed_out_total)
        conn = self.kv_exporter or self.kv_importer
        if conn is not None:
            stats.kv_handoffs_total = conn.handoffs_done
            stats.kv_handoff_bytes_total = conn.bytes_total
            stats.kv_handoff_seconds_total = conn.seconds_total
        if self.kv_exporter is not None:
            stats.kv_handoffs_expired_total = self.kv_exporter.handoffs_expired
            stats.kv_handoff_blocks_held = self.kv_exporter.blocks_held
        return stats



def _kv_tensors(executor: Any) -> list[torch.Tensor]:
    """Every tensor of the executor's KV pools with a block axis at dim 1 (what a handoff copies)."""
    return list(executor.kv_caches) + list(getattr(executor, "kv_scales", None) or [])
