"""The serving benchmark's metric math (TTFT, TPOT, ITL, percentiles, throughput, goodput).

Expected values are computed by hand from the definitions in `vllm bench serve` ,
independently of the code under test.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from trtforge.bench.serve_metrics import SLO, Distribution, RequestRecord, compute_metrics, format_table


def _record(start: float, token_times: list[float], output_len: int | None = None,
            prompt_len: int = 10, error: str | None = None) -> RequestRecord:
    return RequestRecord(start=start, chunk_times=list(token_times), end=token_times[-1] if token_times else None,
                         prompt_len=prompt_len, output_len=len(token_times) if output_len is None else output_len,
                         error=error)


def test_per_request_ttft_tpot_itl_latency():
    r = _record(10.0, [10.5, 10.7, 11.0, 11.6])
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.6)
    assert r.tpot == pytest.approx((1.6 - 0.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])


def test_tpot_counts_tokens_not_chunks():
    # 3 streamed chunks carrying 7 tokens: TPOT divides by output_len - 1, ITL has 2 gaps.
    r = _record(0.0, [1.0, 2.0, 4.0], output_len=7)
    assert r.tpot == pytest.approx((4.0 - 1.0) / 6)
    assert r.itls == pytest.approx([1.0, 2.0])


def test_single_token_output_has_no_tpot():
    r = _record(0.0, [0.25])
    assert r.tpot is None and r.itls == []
    m = compute_metrics([r], 1.0)
    assert m.tpot_ms.count == 0 and math.isnan(m.tpot_ms.mean)
    assert m.ttft_ms.mean == pytest.approx(250.0)


def test_percentiles_interpolate_linearly():
    # 1..100 ms: p50 lies halfway between the 50th and 51st values, p99 between the 99th and 100th.
    d = Distribution.of([i / 1000 for i in range(1, 101)], (50, 90, 99))
    assert d.percentiles[50] == pytest.approx(50.5)
    assert d.percentiles[90] == pytest.approx(90.1)
    assert d.percentiles[99] == pytest.approx(99.01)
    assert d.mean == pytest.approx(50.5) and d.max == pytest.approx(100.0) and d.count == 100


def test_percentile_matches_sorted_rank_definition():
    rng = random.Random(3)
    values = [rng.uniform(0, 5) for _ in range(37)]
    d = Distribution.of(values, (50, 90, 99))
    ordered = sorted(v * 1000 for v in values)
    for p in (50, 90, 99):
        rank = p / 100 * (len(ordered) - 1)
        lo, frac = int(rank), rank - int(rank)
        want = ordered[lo] + frac * (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo])
        assert d.percentiles[p] == pytest.approx(want)


def test_throughputs_and_failed_requests():
    ok1 = _record(0.0, [1.0, 2.0, 3.0], prompt_len=100)
    ok2 = _record(0.5, [1.5, 2.5], prompt_len=50)
    failed = _record(0.0, [1.0], prompt_len=999, error="server error: boom")
    never = RequestRecord(start=0.0, prompt_len=7, error="no final answer within 5 s")
    m = compute_metrics([ok1, ok2, failed, never], duration_s=4.0)
    assert (m.completed, m.failed) == (2, 2)
    assert (m.input_tokens, m.output_tokens) == (150, 5)  # failed requests count for nothing
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(5 / 4)
    assert m.total_token_throughput == pytest.approx(155 / 4)
    assert m.itl_ms.count == 3  # 2 gaps + 1 gap
    assert m.e2el_ms.mean == pytest.approx((3.0 + 2.0) / 2 * 1000)
    assert m.goodput is None  # no SLO given


def test_goodput_counts_requests_meeting_every_slo():
    fast = _record(0.0, [0.1, 0.2, 0.3])        # TTFT 100 ms, TPOT 100 ms
    slow_first = _record(0.0, [0.5, 0.55, 0.6])  # TTFT 500 ms, TPOT 50 ms
    slow_decode = _record(0.0, [0.1, 0.5, 0.9])  # TTFT 100 ms, TPOT 400 ms
    one_token = _record(0.0, [0.15])            # no TPOT: only its TTFT is judged
    records = [fast, slow_first, slow_decode, one_token]
    both = compute_metrics(records, 2.0, SLO(ttft_ms=200, tpot_ms=150))
    assert both.goodput == pytest.approx(2 / 2.0)  # fast, one_token
    ttft_only = compute_metrics(records, 2.0, SLO(ttft_ms=200))
    assert ttft_only.goodput == pytest.approx(3 / 2.0)
    tpot_only = compute_metrics(records, 2.0, SLO(tpot_ms=100))
    assert tpot_only.goodput == pytest.approx(3 / 2.0)  # fast (exactly 100), slow_first, one_token
    assert compute_metrics(records, 2.0, SLO()).goodput is None


def test_invalid_duration_is_refused():
    with pytest.raises(ValueError, match="duration_s=0"):
        compute_metrics([_record(0.0, [1.0])], 0.0)


def test_report_serializes_and_renders():
    m = compute_metrics([_record(0.0, [0.1, 0.3]), _record(0.0, [0.2, 0.5])], 1.0, SLO(ttft_ms=150))
    data = json.loads(json.dumps(m.to_dict()))
    assert data["ttft_ms"]["percentiles"]["50"] == pytest.approx(150.0)
    table = format_table("t", m)
    assert "Request goodput (req/s):" in table and "P99 (ms):" in table
