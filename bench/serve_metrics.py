"""Serving metrics from what a streaming client saw, as `vllm bench serve` defines them.

Per request (times on the client's clock, from sending the request):

    sent ──TTFT──▶ first token ──ITL──▶ token ──ITL──▶ … ──▶ last token = end
    └──────────────────────────── E2E latency ────────────────────────────┘
    TPOT = (E2E latency − TTFT) / (output_len − 1)       (only when output_len > 1)

ITL is every gap between consecutive streamed responses; TPOT is one number per request (its mean
gap, counted in tokens). Throughputs divide by the benchmark's wall time; goodput counts only the
requests that met every given SLO (TTFT and per-request TPOT).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    start: float
    """Client clock (seconds) when the request was sent."""
    chunk_times: list[float] = field(default_factory=list)
    """Client clock when each streamed response carrying tokens arrived, in order."""
    end: float | None = None
    """Client clock when the request's final response arrived."""
    prompt_len: int = 0
    """Prompt tokens (the server's count when it reports one)."""
    output_len: int = 0
    """Tokens generated (the server's count when it reports one, else the streamed responses)."""
    error: str | None = None
    """Why the request failed; None when it succeeded."""
    group: str = "main"
    """Which stream of the workload it belongs to (e.g. `short`, `long`)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class SLO:
    """Service-level objectives a request must all meet to count towards goodput."""

    ttft_ms: float | None = None
    """Most time to first token, in milliseconds (None: no objective)."""
    tpot_ms: float | None = None
    """Most time per output token (the request's mean after the first), in milliseconds."""

    def met_by(self, record: RequestRecord) -> bool:
        if self.ttft_ms is not None and record.ttft * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot or 0.0  # a one-token answer has no inter-token time to miss
        return self.tpot_ms is None or tpot * 1e3 <= self.tpot_ms

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


@dataclass
class Distribution:
    """Summary of one latency metric over the requests (milliseconds)."""

    count: int
    """Samples summarized (requests, or gaps for ITL)."""
    mean: float
    """Arithmetic mean (NaN when there are no samples)."""
    percentiles: dict[int, float]
    """{p: value} with linear interpolation between samples (numpy's default)."""
    max: float
    """Largest sample."""

    @classmethod
    def of(cls, seconds: Iterable[float], percentiles: tuple[int, ...] = PERCENTILES
           ) -> "Distribution":
        import numpy as np  # not at the top: `trtforge --help` imports this module

        values = np.asarray(list(seconds), dtype=np.float64) * 1e3
        if values.size == 0:
            nan = float("nan")
            return cls(0, nan, {p: nan for p in percentiles}, nan)
        return cls(int(values.size), float(values.mean()),
                   {p: float(np.percentile(values, p)) for p in percentiles}, float(values.max()))


@dataclass
class ServeMetrics:
    """The benchmark's results for one group of requests."""

    completed: int
    """Requests that finished without error."""
    failed: int
    """Requests that got an error (or no answer before the timeout)."""
    duration_s: float
    """Wall time the throughputs divide by."""
    input_tokens: int
    """Prompt tokens of the completed requests."""
    output_tokens: int
    """Generated tokens of the completed requests."""
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    total_token_throughput: float
    """Prompt plus generated tokens per second."""
    goodput: float | None
    """Completed requests per second that met every SLO; None when no SLO was given."""
    ttft_ms: Distribution
    """Time to first token."""
    tpot_ms: Distribution
    """Time per output token, one value per request with more than one output token."""
    itl_ms: Distribution
    """Every gap between consecutive streamed responses."""
    e2el_ms: Distribution
    """End-to-end latency."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
                    percentiles: tuple[int, ...] = PERCENTILES) -> ServeMetrics:
    """Summarize `records` over a run of `duration_s` wall seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0 (the benchmark's wall time)")
    done = [r for r in records if r.ok]
    inp = sum(r.prompt_len for r in done)
    out = sum(r.output_len for r in done)
    goodput = None
    if slo is not None and slo.given:
        goodput = sum(slo.met_by(r) for r in done) / duration_s
    tpots = [r.tpot for r in done if r.tpot is not None]
    return ServeMetrics(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        input_tokens=inp, output_tokens=out, request_throughput=len(done) / duration_s,
        output_throughput=out / duration_s, total_token_throughput=(inp + out) / duration_s,
        goodput=goodput,
        ttft_ms=Distribution.of((r.ttft for r in done), percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of((g for r in done for g in r.itls), percentiles),
        e2el_ms=Distribution.of((r.latency for r in done), percentiles),
    )


def format_table(title: str, m: ServeMetrics) -> str:
    """A fixed-width report in the layout of `vllm bench serve`."""
    width = 56
    rows = [f"{f' {title} ':=^{width}}",
            _row("Successful requests", m.completed), _row("Failed requests", m.failed),
            _row("Benchmark duration (s)", f"{m.duration_s:.2f}"),
            _row("Total input tokens", m.input_tokens), _row("Total generated tokens", m.output_tokens),
            _row("Request throughput (req/s)", f"{m.request_throughput:.3f}"),
            _row("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
            _row("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}")]
    if m.goodput is not None:
        rows.append(_row("Request goodput (req/s)", f"{m.goodput:.3f}"))
    for label, dist in (("Time to First Token", m.ttft_ms), ("Time per Output Token (excl. 1st token)",
                        m.tpot_ms), ("Inter-token Latency", m.itl_ms), ("End-to-end Latency", m.e2el_ms)):
        rows.append(f"{f' {label} ':-^{width}}")
        rows.append(_row("Mean (ms)", f"{dist.mean:.2f}"))
        rows += [_row(f"P{p} (ms)", f"{v:.2f}") for p, v in dist.percentiles.items()]
        rows.append(_row("Max (ms)", f"{dist.max:.2f}"))
    rows.append("=" * width)
    return "\n".join(rows)


def _row(label: str, value: object) -> str:
    return f"{label + ':':<40}{value!s:>16}"
