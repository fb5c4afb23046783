"""The engine: one schedule → execute → update loop, used by the CLI, the Triton adapter and the
benchmarks alike.

    add_request / add_handoff ──▶ _admit ──▶ Scheduler (ids, counts, block tables; no tensors)
                        │ schedule(): decodes first, then prefill chunks, within the token budget
                        │ (handed-over requests: connector.load_kv into the blocks they got)
                        ▼
                    prepare_inputs ──▶ Executor (torch network | TensorRT) ──▶ logits
                        │
                    Sampler ──▶ Scheduler.update ──▶ detokenize + stop check ──▶ RequestOutput
                        (context phase: the first token ends it, connector.save_kv → kv_handle)

How it runs (device, KV memory, phase and KV connector, speculative decoding) is its RuntimeConfig;
how it schedules, its SchedulerConfig. With speculative decoding the same loop runs: before
schedule() the proposer drafts tokens for the running decodes (serving/spec_decode/), the step
verifies them, and each request's committed tokens — one or several — go through detokenizer and
stop checks one by one, so a stop inside the accepted drafts ends the request there. A
disaggregated engine (phase context or generation) moves KV through one KVConnector, whose hooks
are the only KV-transfer code here.

Prompt logprobs (SamplingParams.prompt_logprobs): each prefill chunk of such a request also
returns the logits rows of its prompt positions (model_inputs.prepare_inputs, after the sampling
rows), scored at once into the request's PromptLogprobsState (serving/prompt_logprobs.py), so no
more than a chunk's rows exist at a time; the entries go out on the request's first output (the
first token's, or the context phase's handoff). Such a request does not read the prefix cache:
its Sequence gets a prefix-cache namespace of its own (a salt naming the request), so no prompt
position is skipped (vLLM skips the prefix-cache read for these requests too).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from trtforge.config.fields import parse_bytes
from trtforge.config.runtime import Phase, RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.scheduler import SchedulerConfig
from trtforge.config.speculative import SpeculativeConfig, unsupported as speculation_unsupported
from trtforge.models.engine_dir import EngineConfig, read_engine_config
from trtforge.models.kv_sizing import kv_num_blocks
from trtforge.models.tokenizer import load_tokenizer
from trtforge.serving.core.scheduler import EngineOverloaded, Scheduler, SchedulerOutput
from trtforge.serving.core.sequence import Sequence, SequenceStatus
from trtforge.serving.detokenizer import IncrementalDetokenizer
from trtforge.serving.kv_connector import KVConnector, KVHandle, make_connector
from trtforge.serving.outputs import FinishReason, RequestMetrics, RequestOutput
from trtforge.serving.prompt_logprobs import PromptLogprob, PromptLogprobsState
from trtforge.serving.sampler import Sampler, SamplingState
from trtforge.serving.spec_decode.controller import SpecDecodeController
from trtforge.serving.spec_decode.step import sample_step
from trtforge.serving.stop_checker import StopChecker
from trtforge.serving.structured_output import GrammarCompiler, PendingGrammars
from trtforge.serving.worker.cuda_graphs import DEFAULT_BATCH_SIZES
from trtforge.serving.worker.executor import Executor, make_executor
from trtforge.serving.worker.model_inputs import prepare_inputs

_STATUS = {FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
           FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
           FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
           FinishReason.ERROR: SequenceStatus.FINISHED_ABORTED,
           FinishReason.TIMEOUT: SequenceStatus.FINISHED_ABORTED,
           FinishReason.HANDOFF: SequenceStatus.FINISHED_STOPPED}

TopLogprobs = list[tuple[int, float]]
Logprob = tuple[float, TopLogprobs]
"""A sampled token's log-probability and its most likely alternatives (when requested)."""


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
    spec_decode_num_drafts: int = 0
    """Speculative decoding: verifications (decode steps of a request that carried drafts)."""
    spec_decode_num_draft_tokens: int = 0
    """Speculative decoding: draft tokens proposed and verified since start."""
    spec_decode_num_accepted_tokens: int = 0
    """Speculative decoding: of those, accepted (committed without a target step of their own)."""

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
    kv_handle: KVHandle | None = None
    """Generation phase: the handoff whose KV this request waits for (None once imported)."""
    seq: Sequence | None = None
    """The scheduler's Sequence of this request (read only here: its prefix-cache hit)."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache, taken at the first scheduling (None before)."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for this request."""
    num_accepted_tokens: int = 0
    """Of those, accepted."""
    prompt_lp: PromptLogprobsState | None = None
    """Prompt logprobs asked for: the entries scored so far (None: not asked)."""


_PROMPT_LOGPROBS_SALT = "\0trtforge prompt_logprobs\0"
"""Prefix of the prefix-cache namespace of a prompt_logprobs request (then its request id): it
shares no cached block, so every prompt position is computed and scored."""


def num_kv_blocks(cfg: EngineConfig, kv_cache_memory: str | int | None) -> int:
    """Blocks the KV budget buys (engine.json's budget unless overridden), at least one."""
    budget = parse_bytes(kv_cache_memory if kv_cache_memory is not None else cfg.build["kv_cache_memory"])
    return max(1, kv_num_blocks(cfg.model, cfg.dtype, cfg.block_size, budget, cfg.kv_cache_dtype))


_RUNTIME_FIELDS = frozenset(f.name for f in dataclasses.fields(RuntimeConfig))


def check_speculation(cfg: EngineConfig, runtime: RuntimeConfig) -> SpeculativeConfig | None:
    """The speculation `runtime` runs `cfg` with (its own speculative_config, else engine.json's
    default); the combinations it does not support are refused by name (never ignored)."""
    spec = runtime.speculation(cfg.speculative_config)
    if spec is None:
        return None
    where = speculation_unsupported(cfg.backend, cfg.tp_size, runtime.phase is Phase.CONTEXT)
    if where is not None:
        origin = "speculative_config" if runtime.speculative_config is not None else "engine.json's speculative_config"
        raise ValueError(f"speculative decoding ({spec.method}) is not supported with {where}: run without "
                         f"{origin} (speculative_config=none turns an engine's default off)")
    return spec


class LLMEngine:
    """Requests in (add_request, add_handoff), one step() at a time, RequestOutputs out."""

    def __init__(self, engine_config: EngineConfig, runtime: RuntimeConfig, executor: Executor,
                 tokenizer: Any, scheduler_config: SchedulerConfig):
        """`executor` runs `engine_config`'s network over scheduler_config.num_blocks KV blocks;
        `runtime.phase` other than both also opens the phase's KV connector over its pools."""
        speculation = check_speculation(engine_config, runtime)
        self.engine_config = engine_config
        self.runtime = runtime
        self.phase = runtime.phase
        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        # Every layer windowed (ModelConfig.kv_window > 0): blocks before the window are freed.
        self.scheduler = Scheduler(scheduler_config, sliding_window=engine_config.model.kv_window)
        self.sampler = Sampler()
        self.connector: KVConnector | None = None
        """The KV connector of a disaggregated phase (context: exporter; generation: importer)."""
        if self.phase is not Phase.BOTH:
            self.connector = make_connector(runtime, _kv_tensors(executor, self.phase),
                                            scheduler_config.num_blocks, scheduler_config.block_size)
        self._requests: dict[str, _Request] = {}  # by request id, which is also the seq_id
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()  # request ids for callers who give none
        self._eos = tuple(engine_config.model.eos_token_ids)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_refused_total = 0
        self.requests_timed_out_total = 0
        self._deadlines: dict[str, float] = {}  # request id -> monotonic time it times out
        self._grammars: GrammarCompiler | None = None  # built by the first structured-output request
        self._compiling = PendingGrammars()  # requests whose grammar compiles, not yet in the scheduler
        self.spec: SpecDecodeController | None = None
        """Speculative decoding's proposer and adaptive rule (None: one token per decode step)."""
        if speculation is not None:
            self.spec = SpecDecodeController(speculation, target=engine_config, runtime=runtime)

    @classmethod
    def from_engine_dir(cls, path: str | Path, runtime: RuntimeConfig | None = None,
                        **scheduler_overrides: Any) -> LLMEngine:
        """Load an engine directory and run it as `runtime` says (default RuntimeConfig(): on the
        CPU, co-located, engine.json's KV budget). Scheduler parameters default to engine.json's;
        `scheduler_overrides` (SchedulerConfig fields) replace some."""
        runtime = runtime or RuntimeConfig()
        misplaced = sorted(_RUNTIME_FIELDS & set(scheduler_overrides))
        if misplaced:
            raise TypeError(f"{misplaced} are runtime options, not scheduler ones: pass "
                            f"runtime=RuntimeConfig({misplaced[0]}=...)")
        cfg = read_engine_config(path, verify_checksums=runtime.verify_checksums)
        check_speculation(cfg, runtime)  # before any executor (or tensor-parallel rank) starts
        blocks = num_kv_blocks(cfg, runtime.kv_cache_memory)
        sched = SchedulerConfig.for_engine(cfg.build, cfg.scheduling, blocks, scheduler_overrides)
        graph_sizes: tuple[int, ...] = ()
        if runtime.cuda_graphs:
            graph_sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b < sched.max_batch_size) + (sched.max_batch_size,)
        executor = make_executor(str(path), cfg, blocks, runtime.device, graph_sizes)
        return cls(cfg, runtime, executor, load_tokenizer(path), sched)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; raises ValueError with a clear message for a bad one (prompt +
        max_tokens beyond max_seq_len included), EngineOverloaded when the waiting queue is full
        (max_queue_size / max_queued_tokens: retry later)."""
        return self._admit(prompt, params, request_id, arrival_time)

    def add_handoff(self, handle: KVHandle, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Generation phase: continue a request whose prompt KV and first token a context engine
        computed (`handle`: its KVHandle). The KV is copied in when the request is admitted; the
        first token's text is not sent again. Errors as add_request; a handle the connector
        refuses (forged, replayed, foreign, out of range: ValueError) is left alone (it may be
        someone else's), one refused later is released (the context side frees its blocks)."""
        if self.phase is not Phase.GENERATION:
            raise ValueError(f"add_handoff needs an engine in the generation phase (this one: {self.phase})")
        self.connector.check_handoff(handle, vocab_size=self.engine_config.model.vocab_size,
                                     max_seq_len=self.scheduler_config.max_seq_len)
        try:
            return self._admit(list(handle.prompt_token_ids), params, request_id, arrival_time, handle)
        except BaseException:
            self.connector.request_finished(handle)
            raise

    def _admit(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
               arrival_time: float | None, handoff: KVHandle | None = None) -> str:
        """The one admission path: validate, build the request's state, queue its Sequence.
        `handoff`: the request continues from a context engine's prefill and first token (one
        the connector's check_handoff accepted, in add_handoff)."""
        params = (params or SamplingParams()).validate()
        params.check_vocab(self.engine_config.model.vocab_size)  # ids the sampler could not mask
        if params.bad_words:
            params = params.resolve_bad_words(self.tokenizer)
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        arrival = arrival_time or time.monotonic()
        max_tokens = params.max_tokens
        if handoff is None and self.phase is Phase.CONTEXT:
            # Computes the prompt and one token here; the rest must fit the generation engine.
            limit = self.scheduler_config.max_seq_len
            if len(ids) < limit and len(ids) + max_tokens > limit:
                raise ValueError(f"request {rid}: prompt of {len(ids)} tokens + max_tokens="
                                 f"{max_tokens} exceeds max_seq_len={limit}; send max_tokens <= "
                                 f"{limit - len(ids)} for this prompt, or shorten the prompt")
            max_tokens = 1
        state = SamplingState(params=params, prompt_token_ids=ids, eos_token_ids=self._eos,
                              seed=handoff.seed if handoff is not None else None)
        compiling = self._start_grammar(state) if params.is_guided else None
        req = _Request(rid, len(ids), state,
                       IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                       StopChecker(self.scheduler_config.max_seq_len), RequestMetrics(arrival))
        req.prompt_lp, salt = self._prompt_logprobs_state(params, ids, rid, handoff)
        if handoff is not None:
            first = int(handoff.first_token)
            try:
                state.restore_generator(handoff.generator_state)
            except (RuntimeError, ValueError) as exc:  # a state of another torch build
                raise ValueError(f"the handoff's generator state cannot be restored: {exc}") from None
            state.output_token_ids.append(first)
            if state.grammar is not None:  # the context side's grammar chose it: same position here
                state.grammar.replay([first])
            req.cum_logprob, req.kv_handle = handoff.cum_logprob, handoff
            # Replay the first token (its text went out from the context side) so the detokenizer
            # and the stop checker hold exactly the state they would hold co-located.
            _, req.text = req.stop.check(state, first, req.detok.step([first]))
        # The scheduler's Sequence gets its own copies: nothing it holds is shared.
        seq = Sequence(seq_id=rid, prompt_token_ids=list(ids), max_tokens=max_tokens,
                       output_token_ids=list(state.output_token_ids), arrival_time=arrival,
                       num_external_tokens=len(ids) if handoff is not None else 0,
                       external_first_block=handoff.first_block if handoff is not None else 0,
                       cache_salt=salt)
        self._queue(req, seq, compiling)
        self._requests[rid] = req
        if params.timeout_s is not None:
            self._deadlines[rid] = arrival + params.timeout_s
        if handoff is None:  # a handed-over prompt was computed (and counted) on the context side
            self.prompt_tokens_total += len(ids)
        return rid

    def _prompt_logprobs_state(self, params: SamplingParams, ids: list[int], rid: str,
                               handoff: KVHandle | None) -> tuple[PromptLogprobsState | None, str | None]:
        """(the request's PromptLogprobsState, its Sequence's cache salt): without prompt_logprobs
        (None, its own salt); with them, a namespace of its own. Refuses, by name, prompt_logprobs
        where the prompt is not computed here (the generation phase) or where the network returns
        only the sampled rows (a TensorRT plan)."""
        if params.prompt_logprobs is None:
            return None, params.cache_salt
        if handoff is not None or self.phase is Phase.GENERATION:
            raise ValueError("prompt_logprobs: the generation phase continues a prompt the context phase "
                             "computed; ask the context phase (or a co-located engine) for them")
        if self.engine_config.backend == "tensorrt":
            raise ValueError("prompt_logprobs is not supported with the tensorrt backend (its plan returns "
                             "at most max_batch_size logits rows per step): serve with --backend torch")
        return PromptLogprobsState(list(ids), params.prompt_logprobs), f"{_PROMPT_LOGPROBS_SALT}{rid}"

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured-output grammars for this engine's tokenizer and vocabulary
        (padding included), with its LRU cache; built on first use (reading the vocabulary takes
        a moment for a large one)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.engine_config.model.vocab_size, self._eos)
        return self._grammars

    def _start_grammar(self, state: SamplingState) -> Future | None:
        """A cached grammar: the request's matcher now (None). Else its compile, started off the loop
        (its Future): the guide is parsed now, a bad one refuses this request only; what fails
        later (in the compile, or no first token allowed) fails it in `_admit_compiled`."""
        params, compiler = state.params, self.grammar_compiler()
        compiled = compiler.ready(params.guided_decoding_guide_type, params.guided_decoding_guide)
        if compiled is None:
            return compiler.submit(params.guided_decoding_guide_type, params.guided_decoding_guide)
        state.grammar = compiler.matcher(params, compiled)
        return None

    def _queue(self, req: _Request, seq: Sequence, compiling: Future | None) -> None:
        """Hand a new request's Sequence to the scheduler, or, while its grammar compiles, to
        the compiling list (`_admit_compiled` queues it once the grammar is ready)."""
        try:
            if compiling is not None:  # refused now for what `add` would refuse (checked again then)
                self.scheduler.check(seq)
                self._compiling.add(req.request_id, compiling, seq)
                return
            self.scheduler.add(seq)  # validates length and KV need, bounds the waiting queue
        except EngineOverloaded:
            self.requests_refused_total += 1
            raise
        req.seq = seq

    def _admit_compiled(self) -> None:
        """The requests whose grammar has finished compiling join the scheduler's queue, with their
        matcher (a handoff's first token replayed into it); a failed compile, a grammar that admits
        no output, or a queue that no longer takes the request fails that request alone."""
        for rid, seq, compiled, error in self._compiling.pop_ready():
            req = self._requests[rid]
            try:
                if error is not None:
                    raise error
                req.sampling.grammar = self.grammar_compiler().matcher(req.sampling.params, compiled)
                req.sampling.grammar.replay(list(req.sampling.output_token_ids))
                self.scheduler.add(seq)
            except (ValueError, EngineOverloaded) as exc:
                self.requests_refused_total += isinstance(exc, EngineOverloaded)
                error = f"request {rid} failed: {exc}"
                self._pending.append(self._finish(req, FinishReason.ERROR, [], "", error=error))
                continue
            req.seq = seq

    def poll(self) -> None:
        """Housekeeping between steps when idle: the connector frees handoffs taken or past their
        deadline."""
        if self.connector is not None:
            self.connector.poll()

    def close(self) -> None:
        """Release what outlives the process otherwise (the context phase's shared segment)."""
        if self.connector is not None:
            self.connector.close()
        if self._grammars is not None:
            self._grammars.close()

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

    def abort(self, request_id: str, reason: FinishReason | str = FinishReason.ABORT,
              error: str | None = None) -> bool:
        """Cancel a request and free its KV blocks; its final output comes with the next step()."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        reason = FinishReason(reason)
        if not self._compiling.discard(request_id):  # one whose grammar compiles is not in the scheduler
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
        self._admit_compiled()  # before schedule(): a request whose grammar is ready is queued this step
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(self._propose()) if self.spec is not None else self.scheduler.schedule()
        if sched.kv_imports:
            self._load_kv(sched)
        if sched.is_empty:
            self._compiling.wait(0.01)  # only grammars compiling: wait for one rather than spin
            return outputs + self._drain_pending()
        now = time.monotonic()
        for chunk in sched.chunks:
            req = self._requests[chunk.seq_id]
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            if req.num_cached_tokens is None and req.seq is not None:
                # The first admission's hit (a resumed preempted sequence may hit its own
                # outputs too: not prompt tokens served from the cache for the client).
                req.num_cached_tokens = min(req.seq.num_cached_prefix_tokens, req.num_prompt_tokens)
        try:
            sampled, logprobs, failed = self._execute(sched)
        except Exception as exc:  # noqa: BLE001 - a failing batch fails its requests, never the engine
            for chunk in sched.chunks:
                if chunk.seq_id in self._requests:
                    self.abort(chunk.seq_id, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            return outputs + self._drain_pending()
        for rid, error in failed.items():  # rows the sampler could not serve fail alone
            self.abort(rid, FinishReason.ERROR, f"request {rid} failed: {error}")
        self.scheduler.update(sched, sampled)  # skips the aborted ones
        done = time.monotonic()
        for rid, tokens in sampled.items():
            req, lps = self._requests[rid], logprobs.get(rid)
            for j, token in enumerate(tokens):  # committed tokens one by one: a stop ends it there
                out = self._on_token_or_fail(req, token, lps[j] if lps else None, done)
                outputs.append(out)
                if out.finished:
                    break
        return outputs + self._drain_pending()

    def _propose(self) -> dict[str, list[int]]:
        """Speculative decoding: drafts for the running decodes that may speculate."""
        candidates = []
        for rid in self.scheduler.decode_candidates():
            req = self._requests[rid]
            state = req.sampling
            if state.params.speculative and state.grammar is None:
                left = req.seq.max_tokens - len(state.output_token_ids)
                candidates.append((rid, state.prompt_token_ids, state.output_token_ids, left))
        return self.spec.propose(candidates) if candidates else {}

    def _on_token_or_fail(self, req: _Request, token: int, logprob: Logprob | None,
                          now: float) -> RequestOutput:
        """`_on_token`, except that an exception there (detokenizing, stop checking) fails this
        request alone, with finish reason error."""
        try:
            return self._on_token(req, token, logprob, now)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the batch
            try:
                self.scheduler.finish(req.request_id, _STATUS[FinishReason.ERROR])
            except ValueError:
                pass  # the scheduler had finished it before the exception
            return self._finish(req, FinishReason.ERROR, [], "",
                                error=f"request {req.request_id} failed: {type(exc).__name__}: {exc}")

    def _expire_deadlines(self) -> None:
        """Abort the requests past their deadline, waiting or running, freeing their KV blocks."""
        if not self._deadlines:
            return
        now = time.monotonic()
        for rid in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            req = self._requests[rid]
            self.requests_timed_out_total += 1
            self.abort(rid, FinishReason.TIMEOUT,
                       f"deadline exceeded: timeout_s={req.sampling.params.timeout_s:g} passed after "
                       f"{len(req.sampling.output_token_ids)} generated tokens; the request was "
                       "aborted (send a longer timeout_s or a smaller max_tokens)")

    def _load_kv(self, sched: SchedulerOutput) -> None:
        """Hook (a): copy handed-over KV into the blocks the scheduler gave it; a failed import
        fails that request alone (its chunk leaves the batch)."""
        failed = set()
        for imp in sched.kv_imports:
            req = self._requests.get(imp.seq_id)
            if req is None or req.kv_handle is None:
                continue
            handle, req.kv_handle = req.kv_handle, None
            try:
                self.connector.load_kv(handle, imp.block_table)
            except Exception as exc:  # noqa: BLE001 - expired handle, owner gone: this request only
                failed.add(imp.seq_id)
                self.abort(imp.seq_id, FinishReason.ERROR, f"KV handoff failed: {exc}")
        if failed:
            sched.chunks = [c for c in sched.chunks if c.seq_id not in failed]

    def _drain_pending(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def _execute(self, sched: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, list[Logprob]],
                                                        dict[str, str]]:
        """Run the batch and sample: {request id: its committed tokens} (one, or a verification's
        accepted drafts + one), where requested {request id: their logprobs}, and {request id:
        error} for the requests the sampler could not serve (they get no token)."""
        wanted = {c.seq_id: (lp.next_position, lp.end_position) for c in sched.chunks
                  if (lp := getattr(self._requests.get(c.seq_id), "prompt_lp", None)) is not None and not lp.done}
        inputs = prepare_inputs(sched, self.scheduler_config.block_size, self.executor.device, wanted)
        logits = self.executor.execute(inputs)  # always: a non-sampling prefill chunk still writes KV
        prompt_failed = self._score_prompt(inputs, logits)
        logits = logits[:inputs.num_sample_rows]
        if not inputs.sample_seq_ids:
            return {}, {}, prompt_failed
        ids = inputs.sample_seq_ids
        if any(n > 1 for n in inputs.sample_num_rows):  # a speculative verification is in the batch
            step = sample_step(self.sampler, logits, inputs, sched, {i: self._requests[i].sampling for i in ids})
            for rid, (proposed, accepted) in step.drafts.items():
                self.spec.record(rid, proposed, accepted)
                req = self._requests[rid]
                req.num_draft_tokens += proposed
                req.num_accepted_tokens += accepted
            return step.tokens, step.logprobs, {**step.failed, **prompt_failed}
        result = self.sampler.sample(logits, [self._requests[i].sampling for i in ids])
        failed = {**prompt_failed, **{ids[row]: error for row, error in result.errors.items()}}
        sampled = {i: [t] for i, t in zip(ids, result.token_ids) if i not in failed}
        logprobs = {i: [(lp, top)] for i, lp, top in zip(ids, result.logprobs, result.top_logprobs)
                    if lp is not None and i not in failed}
        return sampled, logprobs, failed

    def _score_prompt(self, inputs: Any, logits: torch.Tensor) -> dict[str, str]:
        """Score the prompt-logprob rows (after the sampling rows) into their requests' states;
        {request id: error} for a request whose rows could not be scored (it fails alone)."""
        failed: dict[str, str] = {}
        row = inputs.num_sample_rows
        for seq_id, first, n in inputs.prompt_rows:
            try:
                self._requests[seq_id].prompt_lp.add(first, logits[row:row + n])
            except Exception as exc:  # noqa: BLE001 - this request only
                failed[seq_id] = f"{type(exc).__name__}: {exc}"
            row += n
        return failed

    @staticmethod
    def _prompt_logprobs(req: _Request) -> list[PromptLogprob] | None:
        """The request's prompt logprobs for the output now being built: once, on its first."""
        return req.prompt_lp.take() if req.prompt_lp is not None else None

    def _on_token(self, req: _Request, token: int, logprob: Logprob | None, now: float) -> RequestOutput:
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.token_times.append(now)
        req.sampling.output_token_ids.append(token)  # the engine's copy; the scheduler keeps its own
        self.generation_tokens_total += 1
        grammar = req.sampling.grammar
        if grammar is not None:  # structured output: advance the matcher (a refusal fails this request)
            grammar.accept(token)
        if logprob is not None:
            req.cum_logprob += logprob[0]
        delta = req.detok.step([token])
        reason, text = req.stop.check(req.sampling, token, delta)
        if reason is None and grammar is not None and grammar.is_terminated:
            reason = FinishReason.STOP  # the grammar is complete and ended (ignore_eos or min_tokens aside)
        lps: list[float] | None = [logprob[0]] if logprob is not None else None
        tops: list[TopLogprobs] | None = [logprob[1]] if logprob is not None else None
        if reason is None and self.phase is Phase.CONTEXT:  # the prefill is done: hand it over
            return self._save_kv(req, token, text, lps, tops)
        if reason is None:
            req.text += text
            return RequestOutput(prompt_logprobs=self._prompt_logprobs(req),
                                 request_id=req.request_id, new_token_ids=[token], text_delta=text,
                                 output_token_ids=list(req.sampling.output_token_ids), text=req.text,
                                 finished=False, finish_reason=None,
                                 num_prompt_tokens=req.num_prompt_tokens, metrics=m, logprobs=lps,
                                 top_logprobs=tops,
                                 cum_logprob=req.cum_logprob if logprob is not None else None,
                                 num_cached_tokens=req.num_cached_tokens or 0,
                                 num_draft_tokens=req.num_draft_tokens,
                                 num_accepted_tokens=req.num_accepted_tokens)
        if not isinstance(req.stop.stop_reason, str):  # not cut at a stop string: flush the tail
            text += req.stop.release(req.detok.flush())
        self.scheduler.finish(req.request_id, _STATUS[reason])
        return self._finish(req, reason, [token], text, logprobs=lps, top_logprobs=tops)

    def _save_kv(self, req: _Request, token: int, text: str, logprobs: list[float] | None,
                 top_logprobs: list[TopLogprobs] | None) -> RequestOutput:
        """Hook (b), context phase: the prompt is computed and the first token sampled; export the
        KV and end the request here (its pool blocks are freed; the copy waits in the connector)."""
        blocks, computed = self.scheduler.kv_blocks(req.request_id)
        state = req.sampling
        try:
            handle = self.connector.save_kv(
                req.request_id, blocks[:-(-computed // self.scheduler_config.block_size)], computed,
                prompt_token_ids=list(state.prompt_token_ids), first_token=token, seed=state.seed,
                generator_state=state.generator_state(), cum_logprob=req.cum_logprob)
        except Exception as exc:  # noqa: BLE001 - a full handoff area fails this request only
            self.scheduler.finish(req.request_id, _STATUS[FinishReason.ERROR])
            return self._finish(req, FinishReason.ERROR, [], "", error=f"KV handoff failed: {exc}")
        self.scheduler.finish(req.request_id, _STATUS[FinishReason.HANDOFF])
        return self._finish(req, FinishReason.HANDOFF, [token], text, logprobs=logprobs,
                            top_logprobs=top_logprobs, kv_handle=handle)

    def _finish(self, req: _Request, reason: FinishReason, new_ids: list[int], text: str, *,
                error: str | None = None, logprobs: list[float] | None = None,
                top_logprobs: list[TopLogprobs] | None = None,
                kv_handle: KVHandle | None = None) -> RequestOutput:
        """The final output of a request whose Sequence the scheduler has finished."""
        if self.connector is not None:  # hook (c): e.g. a handoff never imported is released
            self.connector.request_finished(req.kv_handle)
            req.kv_handle = None
        if self.spec is not None:
            self.spec.forget(req.request_id)
        req.metrics.finished_time = time.monotonic()
        req.text += text
        del self._requests[req.request_id]
        self._deadlines.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, text_delta=text,
            output_token_ids=list(req.sampling.output_token_ids), text=req.text, finished=True,
            finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens, metrics=req.metrics,
            logprobs=logprobs, top_logprobs=top_logprobs,
            cum_logprob=req.cum_logprob if req.sampling.params.logprobs is not None else None,
            error=error, stop_reason=req.stop.stop_reason, kv_handle=kv_handle,
            num_cached_tokens=req.num_cached_tokens or 0, num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            prompt_logprobs=self._prompt_logprobs(req) if new_ids else None)  # not on an abort

    # ---- conveniences -----------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts together to completion; final outputs in input order (with the logprobs of
        all output tokens when requested). Prompts are queued as the waiting queue takes them
        (max_queue_size / max_queued_tokens): more prompts than it holds wait their turn here
        instead of being refused. A bad prompt withdraws every request of the call and raises."""
        todo = iter(zip(prompts, params if isinstance(params, list) else itertools.repeat(params)))
        nxt = next(todo, None)
        rids: list[str] = []
        final: dict[str, RequestOutput] = {}
        lps: dict[str, list[float]] = {}
        tops: dict[str, list[TopLogprobs]] = {}
        prompt_lps: dict[str, list[PromptLogprob]] = {}
        try:
            while nxt is not None or len(final) < len(rids):
                while nxt is not None:
                    try:
                        rid = self.add_request(*nxt)
                    except EngineOverloaded:
                        if not self.has_unfinished():  # nothing will make room for it
                            raise
                        break  # step, then queue the rest
                    rids.append(rid)
                    lps[rid], tops[rid] = [], []
                    nxt = next(todo, None)
                for out in self.step():
                    prompt_lps[out.request_id] = (out.prompt_logprobs if out.prompt_logprobs is not None
                                                  else prompt_lps.get(out.request_id))
                    if out.logprobs is not None and out.request_id in lps:
                        lps[out.request_id] += out.logprobs
                        tops[out.request_id] += out.top_logprobs or []
                    if out.finished:
                        if lps.get(out.request_id):  # the final output carries every token's logprobs
                            out.logprobs, out.top_logprobs = lps[out.request_id], tops[out.request_id]
                        out.prompt_logprobs = prompt_lps[out.request_id]  # and the prompt's, sent on the first
                        final[out.request_id] = out
        except (ValueError, EngineOverloaded):  # withdraw the ones queued or running, then report
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
            self._pending.clear()
            raise
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
        stats = EngineStats(
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions=sched.num_preemptions, prefix_cache_queried_tokens=kv.num_queried_tokens,
            prefix_cache_hit_tokens=kv.num_hit_tokens, requests_refused_total=self.requests_refused_total,
            requests_timed_out_total=self.requests_timed_out_total)
        if self.spec is not None:
            spec = self.spec.stats
            stats.spec_decode_num_drafts = spec.num_drafts
            stats.spec_decode_num_draft_tokens = spec.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
        if self.connector is not None:
            handoffs = self.connector.stats()
            stats.kv_handoffs_total = handoffs.handoffs
            stats.kv_handoff_bytes_total = handoffs.nbytes
            stats.kv_handoff_seconds_total = handoffs.seconds
            stats.kv_handoffs_expired_total = handoffs.expired
            stats.kv_handoff_blocks_held = handoffs.blocks_held
        return stats


def _kv_tensors(executor: Any, phase: Phase) -> list[torch.Tensor]:
    """Every tensor of the executor's KV pools with a block axis at dim 1 (what a handoff copies)."""
    if not hasattr(executor, "kv_caches"):
        raise ValueError(f"phase={phase} (disaggregated serving) hands over the KV pools of this "
                         "process; a tensor-parallel engine (tp_size > 1) keeps them in its ranks: "
                         "not supported yet, serve it co-located")
    return list(executor.kv_caches) + list(getattr(executor, "kv_scales", None) or [])
