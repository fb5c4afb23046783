"""`trtforge bench serve`: load a running Triton server with streaming requests, like `vllm bench
serve`, and report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.

    prompts of exact token lengths ──▶ arrivals (Poisson at --request-rate, or all at once)
                                        gated by --concurrency
                                      ──▶ one gRPC stream per request (tritonclient aio)
                                      ──▶ a timestamp per streamed response ──▶ serve_metrics

Every request asks for exactly `output_len` tokens: `min_tokens = max_tokens` keeps EOS (and the
stop tokens) from ending it early — the ensemble's way of saying `ignore_eos`. With
`return_log_probs` the server sends one response per generated token even when the token adds no
text (a partial UTF-8 character, or, with the random-weight demo model, an id outside its small
tokenizer's vocabulary), so TTFT and ITL time tokens rather than text pieces.

An optional second stream of long prompts (`--long-num`) arrives at fixed times while the main
requests keep coming; each group is reported on its own. This is the prefill/decode interference
experiment: decoding requests stall while a long prompt is prefilled, less so with chunked prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import click

from trtforge.bench.serve_metrics import SLO, RequestRecord, compute_metrics, format_table
from trtforge.config.fields import dataclass_options, pick

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeBenchConfig:
    """Options of `trtforge bench serve` (the CLI reads its defaults and help from here)."""

    url: str = "127.0.0.1:8001"
    """gRPC address HOST:PORT of the Triton server (loopback only)."""
    protocol: str = "grpc"
    """Client protocol; grpc (streaming, tritonclient) is the one supported."""
    model: str = "ensemble"
    """Model to call."""
    tokenizer: str | None = None
    """Directory with the served model's tokenizer (engine dir or checkpoint), used to build prompts
    of exactly --input-len tokens. Required."""
    num_prompts: int = 32
    """Main requests to send (an upper bound when --long-num > 0)."""
    input_len: int = 128
    """Prompt length of the main requests, in tokens."""
    output_len: int = 64
    """Tokens each main request generates (exactly, with --ignore-eos)."""
    concurrency: int | None = None
    """Most main requests in flight at once (default: no limit)."""
    request_rate: float = math.inf
    """Main requests per second, Poisson arrivals; inf sends them all at once (then --concurrency
    gates them)."""
    seed: int = 0
    """Seed of the prompts and the arrival times."""
    ignore_eos: bool = True
    """Generate exactly the asked number of tokens (sends min_tokens = max_tokens)."""
    return_log_probs: bool = True
    """Ask for log-probabilities: one streamed response per token, even for tokens without text."""
    long_num: int = 0
    """Long prompts to send alongside the main stream (0: none). While they run, main requests keep
    arriving; once the last one has finished no new main request starts."""
    long_input_len: int = 2000
    """Prompt length of the long requests, in tokens."""
    long_output_len: int = 4
    """Tokens each long request generates."""
    long_start_s: float = 5.0
    """When the first long request is sent, in seconds after the start."""
    long_interval_s: float = 10.0
    """Seconds between long requests."""
    slo_ttft_ms: float | None = None
    """Goodput SLO: most time to first token, in ms."""
    slo_tpot_ms: float | None = None
    """Goodput SLO: most time per output token, in ms."""
    timeout_s: float = 600.0
    """A request with no answer for this long fails (and is cancelled)."""
    warmup: int = 1
    """Unmeasured short requests sent first (loads lazy paths, opens the connection)."""

    def validate(self) -> None:
        """Raise click.BadParameter naming the offending option."""
        if self.protocol != "grpc":
            raise click.BadParameter(f"{self.protocol!r} is not supported; use grpc", param_hint="--protocol")
        host = urlsplit(f"//{self.url}").hostname
        if host not in LOOPBACK:
            raise click.BadParameter(f"{self.url!r}: this benchmark only talks to a server on this machine "
                                     f"({', '.join(LOOPBACK)}); pass e.g. 127.0.0.1:8001", param_hint="--url")
        for name in ("num_prompts", "input_len", "output_len", "long_input_len", "long_output_len"):
            if getattr(self, name) < 1:
                raise click.BadParameter(f"{getattr(self, name)} must be >= 1", param_hint=_opt(name))
        if self.concurrency is not None and self.concurrency < 1:
            raise click.BadParameter(f"{self.concurrency} must be >= 1 (or left out)", param_hint="--concurrency")
        if not self.request_rate > 0:
            raise click.BadParameter(f"{self.request_rate} must be > 0 (inf: all at once)",
                                     param_hint="--request-rate")
        if self.tokenizer is None:
            raise click.BadParameter("needed to build prompts of exact token lengths: pass the engine "
                                     "directory (or the checkpoint) of the served model", param_hint="--tokenizer")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_ms, self.slo_tpot_ms)


def _opt(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- prompts ----------------------------------------------------------------------------------
def word_pieces(tokenizer: Any, limit: int = 4000) -> list[str]:
    """Texts " word" that are one token each and stay one token: byte-level BPE pre-tokenizers
    split text before every " word", so a string of n of them encodes to exactly n tokens."""
    pieces = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if (len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
                and tokenizer.encode(text, add_special_tokens=False) == [token_id]):
            pieces.append(text)
            if len(pieces) >= limit:
                break
    if len(pieces) < 8:
        raise ValueError(f"the tokenizer has only {len(pieces)} single-token ' word' pieces; this benchmark "
                         "builds prompts from them (byte-level BPE tokenizers such as Qwen's, Llama 3's "
                         "and GPT-2's have thousands)")
    return pieces


def make_prompts(tokenizer: Any, pieces: list[str], count: int, num_tokens: int,
                 rng: random.Random) -> list[str]:
    """`count` random prompts that the tokenizer encodes to exactly `num_tokens` tokens."""
    prompts = []
    for _ in range(count):
        text = "".join(rng.choice(pieces) for _ in range(num_tokens))
        got = len(tokenizer.encode(text, add_special_tokens=False))
        if got != num_tokens:
            raise RuntimeError(f"a prompt of {num_tokens} word pieces encodes to {got} tokens; this "
                               "tokenizer merges across spaces, which the prompt builder assumes it does not")
        prompts.append(text)
    return prompts


# -- one request ------------------------------------------------------------------------------
def _infer_inputs(prompt: str, output_len: int, cfg: ServeBenchConfig) -> list[Any]:
    from trtforge.model_repo.client import grpc_inputs  # numpy, tritonclient

    return grpc_inputs(prompt, output_len, stream=True,
                       min_tokens=output_len if cfg.ignore_eos else None,
                       return_log_probs=True if cfg.return_log_probs else None)


def _tokens_in(result: Any) -> int:
    """Generated tokens carried by one streamed response (0 for an empty one)."""
    logprobs = result.as_numpy("output_log_probs")
    if logprobs is not None and logprobs.size:
        return int(logprobs.size)
    text = result.as_numpy("text_output")
    return int(text is not None and any(bytes(t) for t in text.reshape(-1)))  # as_numpy: an ndarray


async def send_request(client: Any, cfg: ServeBenchConfig, prompt: str, output_len: int,
                       group: str) -> RequestRecord:
    """Stream one request; never raises (a failure is recorded in the record's `error`)."""
    inputs = _infer_inputs(prompt, output_len, cfg)

    async def requests():
        yield {"model_name": cfg.model, "inputs": inputs, "request_id": uuid.uuid4().hex}

    record = RequestRecord(start=time.perf_counter(), group=group)
    streamed, final = 0, False
    responses = client.stream_infer(requests())
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async for result, error in responses:
                now = time.perf_counter()
                if error is not None:
                    record.error = str(error)
                    break
                n = _tokens_in(result)
                if n:
                    record.chunk_times.append(now)
                    streamed += n
                count = result.as_numpy("num_output_tokens")
                if count is not None:  # only the final response carries the counts
                    record.output_len = int(count.reshape(-1)[0])
                    record.prompt_len = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                    record.end = now
                    final = True
                    break
                if result.get_response().parameters["triton_final_response"].bool_param:
                    final = True
                    break
    except TimeoutError:
        record.error = f"no final answer within {cfg.timeout_s:.0f} s (--timeout-s)"
    except Exception as exc:  # noqa: BLE001 - a connection error fails this request, not the run
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not final:  # cancel only an unfinished request: a cancel after the final response
            responses.cancel()  # could keep Triton 2.51's python model from unloading
    if record.error is None and record.end is None:
        if streamed:  # the server closed the stream without counts: trust what was streamed
            record.end, record.output_len = record.chunk_times[-1], streamed
        else:
            record.error = "the stream ended without any generated token"
    return record


# -- the run ----------------------------------------------------------------------------------
async def _main_stream(client: Any, cfg: ServeBenchConfig, prompts: list[str], rng: random.Random,
                       stop: asyncio.Event) -> list[RequestRecord]:
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None

    async def gated(prompt: str) -> RequestRecord:
        try:
            return await send_request(client, cfg, prompt, cfg.output_len, "main")
        finally:
            if gate:
                gate.release()

    tasks = []
    for prompt in prompts:
        if gate:
            await gate.acquire()
        if stop.is_set():
            if gate:
                gate.release()
            break
        tasks.append(asyncio.create_task(gated(prompt)))
        if math.isfinite(cfg.request_rate):
            await asyncio.sleep(rng.expovariate(cfg.request_rate))
    return list(await asyncio.gather(*tasks))


async def _long_stream(client: Any, cfg: ServeBenchConfig, prompts: list[str],
                       stop: asyncio.Event) -> list[RequestRecord]:
    async def at(delay: float, prompt: str) -> RequestRecord:
        await asyncio.sleep(delay)
        return await send_request(client, cfg, prompt, cfg.long_output_len, "long")

    records = await asyncio.gather(*(at(cfg.long_start_s + i * cfg.long_interval_s, p)
                                     for i, p in enumerate(prompts)))
    if prompts:  # the main stream runs to --num-prompts when there is no long stream
        stop.set()
    return list(records)


async def run_benchmark(cfg: ServeBenchConfig, main_prompts: list[str], long_prompts: list[str],
                        warmup_prompt: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send the workload; return every request's record and the measured wall time."""
    import tritonclient.grpc.aio as grpcclient

    rng = random.Random(cfg.seed)
    client = grpcclient.InferenceServerClient(cfg.url)
    try:
        for _ in range(cfg.warmup if warmup_prompt else 0):
            record = await send_request(client, cfg, warmup_prompt, 2, "warmup")
            if record.error:
                raise ConnectionError(f"the warm-up request to {cfg.url} (model {cfg.model!r}) failed: "
                                      f"{record.error}. Is a trtforge Triton server running there?")
        stop = asyncio.Event()
        start = time.perf_counter()
        main, long = await asyncio.gather(_main_stream(client, cfg, main_prompts, rng, stop),
                                          _long_stream(client, cfg, long_prompts, stop))
        records = main + long
        ends = [r.end for r in records if r.end is not None]
        duration = (max(ends) if ends else time.perf_counter()) - start
    finally:
        await client.close()
    return records, duration


def build_workload(cfg: ServeBenchConfig, tokenizer: Any) -> tuple[list[str], list[str], str]:
    """(main prompts, long prompts, warm-up prompt), reproducible from cfg.seed."""
    rng = random.Random(cfg.seed)
    pieces = word_pieces(tokenizer)
    main = make_prompts(tokenizer, pieces, cfg.num_prompts, cfg.input_len, rng)
    long = make_prompts(tokenizer, pieces, cfg.long_num, cfg.long_input_len, rng)
    return main, long, make_prompts(tokenizer, pieces, 1, 8, rng)[0]


def summarize(cfg: ServeBenchConfig, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """{"config", "metrics": {group: ServeMetrics dict}, "requests"} — the JSON report."""
    groups = sorted({r.group for r in records}, key=lambda g: (g != "main", g))
    metrics = {g: compute_metrics([r for r in records if r.group == g], duration, cfg.slo) for g in groups}
    return {"config": dataclasses.asdict(cfg), "metrics": {g: m.to_dict() for g, m in metrics.items()},
            "tables": {g: format_table(f"Serving benchmark: {g} requests", m) for g, m in metrics.items()},
            "requests": [dataclasses.asdict(r) for r in records]}


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@dataclass_options(ServeBenchConfig)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON here.")
def serve(json_path: str | None, **options: Any) -> None:
    """Benchmark a running trtforge Triton server (model `ensemble`) over gRPC streaming: TTFT,
    TPOT, ITL, E2E latency at p50/p90/p99, throughput and goodput (as `vllm bench serve`)."""
    from trtforge.models.tokenizer import load_tokenizer  # transformers is slow to import

    cfg = dataclasses.replace(ServeBenchConfig(), **pick(ServeBenchConfig, options))
    cfg.validate()
    main, long, warm = build_workload(cfg, load_tokenizer(cfg.tokenizer))
    try:
        records, duration = asyncio.run(run_benchmark(cfg, main, long, warm))
    except ConnectionError as exc:
        raise click.ClickException(str(exc)) from None
    report = summarize(cfg, records, duration)
    for table in report["tables"].values():
        click.echo(table)
    errors = sorted({r.error for r in records if r.error})
    for error in errors[:5]:
        click.echo(f"error: {error}", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2, allow_nan=True)
        click.echo(f"JSON report: {json_path}")


if __name__ == "__main__":
    serve()
