"""Engine metrics on Triton's metrics port, through the python backend's custom-metrics API.

Triton 2.51's python backend has COUNTER, GAUGE and HISTOGRAM metric families
(`pb_utils.MetricFamily`); a histogram metric takes its bucket bounds at creation. Names follow
Prometheus conventions with a `trtforge_` prefix; every metric carries the model's name and
version as labels, like Triton's own `nv_*` metrics. The queue and KV-pool gauges are also
exported under TensorRT-LLM's backend's names (`nv_trt_llm_*`), which Kubernetes routers such as
llm-d's endpoint picker read from Triton pods.

Only the engine loop thread calls `update`/`observe_finished`, so no lock is needed here.
"""

from __future__ import annotations

from typing import Any

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

# (attribute, metric name, description, kind)
_FAMILIES = [
    ("kv_blocks_used", "trtforge_kv_blocks_used", "KV cache blocks held by requests.", "GAUGE"),
    ("kv_blocks_total", "trtforge_kv_blocks_total", "KV cache blocks in the pool.", "GAUGE"),
    ("num_running", "trtforge_requests_running", "Requests admitted and holding KV blocks.", "GAUGE"),
    ("num_waiting", "trtforge_requests_waiting", "Requests queued for admission.", "GAUGE"),
    ("prompt_tokens_total", "trtforge_prompt_tokens_total", "Prompt tokens computed (prefill).",
     "COUNTER"),
    ("generation_tokens_total", "trtforge_generation_tokens_total", "Tokens generated (decode).",
     "COUNTER"),
    ("prefix_cache_queried_tokens", "trtforge_prefix_cache_queries_total",
     "Tokens looked up in the prefix cache when requests were admitted (or resumed).", "COUNTER"),
    ("prefix_cache_hit_tokens", "trtforge_prefix_cache_hits_total",
     "Of those, tokens whose KV was reused from the prefix cache instead of computed.", "COUNTER"),
    ("prefix_cache_hit_rate", "trtforge_prefix_cache_hit_rate",
     "Prefix-cache hit tokens / queried tokens since start.", "GAUGE"),
    ("requests_refused_total", "trtforge_requests_refused_total",
     "Requests refused at once because the waiting queue was full (max_queue_size, "
     "max_queued_tokens).", "COUNTER"),
    ("requests_timed_out_total", "trtforge_requests_timed_out_total",
     "Requests aborted because they passed their deadline (timeout_s).", "COUNTER"),
    # Speculative decoding (speculative_config; 0 without it), vLLM's spec_decode counters.
    ("spec_decode_num_drafts", "trtforge_spec_decode_num_drafts_total",
     "Verification steps of sequences that carried draft tokens.", "COUNTER"),
    ("spec_decode_num_draft_tokens", "trtforge_spec_decode_num_draft_tokens_total",
     "Draft tokens proposed and verified.", "COUNTER"),
    ("spec_decode_num_accepted_tokens", "trtforge_spec_decode_num_accepted_tokens_total",
     "Draft tokens accepted (each saves one decode step).", "COUNTER"),
    # Disaggregated serving (context and generation models; 0 on a co-located model).
    ("kv_handoffs_total", "trtforge_kv_handoffs_total",
     "KV handoffs done: taken by a generation model (context model), imported (generation model).",
     "COUNTER"),
    ("kv_handoff_bytes_total", "trtforge_kv_handoff_bytes_total",
     "Bytes of K/V copied for handoffs (context: into shared memory; generation: out of it).",
     "COUNTER"),
    ("kv_handoff_seconds_total", "trtforge_kv_handoff_seconds_total",
     "Time spent copying K/V for handoffs.", "COUNTER"),
    ("kv_handoffs_expired_total", "trtforge_kv_handoffs_expired_total",
     "Handoffs the context model freed because no generation model took them in time.", "COUNTER"),
    ("kv_handoff_blocks_held", "trtforge_kv_handoff_blocks_held",
     "Shared-memory KV blocks held by handoffs not yet taken (context model).", "GAUGE"),
]


# TensorRT-LLM's names for the same gauges (its tensorrtllm backend's), labelled the way it labels
# them: what llm-d's endpoint picker reads from a "triton-tensorrt-llm" pool
# (-totalQueuedRequestsMetric nv_trt_llm_request_metrics{request_type=waiting},
#  -kvCacheUsagePercentageMetric nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}).
_TRTLLM_FAMILIES = [
    ("nv_trt_llm_request_metrics", "TRT LLM request metrics (trtforge: requests by state).", "request_type",
     {"active": lambda s: s.num_running + s.num_waiting, "scheduled": lambda s: s.num_running,
      "waiting": lambda s: s.num_waiting}),
    ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics (trtforge: the paged KV pool).",
     "kv_cache_block_type",
     {"max": lambda s: s.kv_blocks_total, "used": lambda s: s.kv_blocks_used,
      "free": lambda s: s.kv_blocks_total - s.kv_blocks_used,
      "fraction": lambda s: s.kv_blocks_used / max(s.kv_blocks_total, 1)}),
]


def time_to_first_token(metrics: Any) -> float | None:
    """Seconds from arrival to the first generated token, or None if there was none."""
    first = getattr(metrics, "first_token_time", None)
    arrival = getattr(metrics, "arrival_time", None)
    return None if first is None or arrival is None else max(0.0, first - arrival)


def time_per_output_token(metrics: Any, num_output_tokens: int) -> float | None:
    """(finish - first token) / (n - 1), as `vllm bench serve` defines TPOT; None for n < 2."""
    first = getattr(metrics, "first_token_time", None)
    finished = getattr(metrics, "finished_time", None)
    if first is None or finished is None or num_output_tokens < 2:
        return None
    return max(0.0, finished - first) / (num_output_tokens - 1)


class EngineMetrics:
    """The engine's gauges, counters and latency histograms, registered with Triton."""

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        self._families = []  # keep the families alive as long as their metrics
        self._metrics: dict[str, Any] = {}
        for attr, name, doc, kind in _FAMILIES:
            family = pb_utils.MetricFamily(name=name, description=doc,
                                           kind=getattr(pb_utils.MetricFamily, kind))
            self._families.append(family)
            self._metrics[attr] = family.Metric(labels=labels)
        hist = pb_utils.MetricFamily.HISTOGRAM
        for attr, name, doc, buckets in (
            ("ttft", "trtforge_time_to_first_token_seconds",
             "Time from request arrival to its first generated token.", TTFT_BUCKETS),
            ("tpot", "trtforge_time_per_output_token_seconds",
             "Mean time between generated tokens of a request, after the first.", TPOT_BUCKETS),
        ):
            family = pb_utils.MetricFamily(name=name, description=doc, kind=hist)
            self._families.append(family)
            self._metrics[attr] = family.Metric(labels=labels, buckets=buckets)
        self._trtllm = []
        for name, doc, label, values in _TRTLLM_FAMILIES:
            family = pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)
            self._trtllm += [(family.Metric(labels={**labels, label: key}), value) for key, value in values.items()]
        # Totals already added to each counter: the engine reports running totals, Prometheus
        # counters only grow by increments.
        self._sent = {attr: 0.0 for attr, _, _, kind in _FAMILIES if kind == "COUNTER"}

    def update(self, stats: Any) -> None:
        """Copy an EngineStats snapshot into the gauges; add counter growth since last time."""
        for attr, _, _, kind in _FAMILIES:
            value = float(getattr(stats, attr))
            if kind == "GAUGE":
                self._metrics[attr].set(value)
            elif value > self._sent[attr]:
                self._metrics[attr].increment(value - self._sent[attr])
                self._sent[attr] = value
        for metric, value in self._trtllm:
            metric.set(float(value(stats)))

    def observe_finished(self, request_metrics: Any, num_output_tokens: int, ttft: bool = True) -> None:
        """Record TTFT and TPOT of a request that just finished (ttft=False: a generation model,
        whose first token came from the context model)."""
        ttft = time_to_first_token(request_metrics) if ttft else None
        if ttft is not None:
            self._metrics["ttft"].observe(ttft)
        tpot = time_per_output_token(request_metrics, num_output_tokens)
        if tpot is not None:
            self._metrics["tpot"].observe(tpot)
