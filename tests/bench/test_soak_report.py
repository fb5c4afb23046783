"""The soak's request plan and its summaries (no server: the soak itself is `trtforge bench soak`)."""

from __future__ import annotations

from collections import Counter

import pytest

from trtforge.bench import soak_report as R
from trtforge.bench.soak_clients import Outcome
from trtforge.bench.soak_workload import CUT_AFTER, CUT_MAX_TOKENS, MALFORMED, MIX, make_plan


def test_plan_is_reproducible_and_follows_the_mix():
    plan = make_plan(20_000, seed=3)
    assert plan == make_plan(20_000, seed=3) and plan != make_plan(20_000, seed=4)
    shares = Counter(p.kind for p in plan)
    for kind, share in MIX.items():
        assert shares[kind] / len(plan) == pytest.approx(share, abs=0.01)
    groups = Counter(p.group for p in plan)
    assert groups["cut"] / len(plan) == pytest.approx(0.30, abs=0.01)
    assert groups["malformed"] / len(plan) == pytest.approx(0.15, abs=0.01)
    assert {p.variant for p in plan if p.group == "malformed"} == set(MALFORMED)
    # A cut request must still be generating when it is cut.
    assert all(p.max_tokens == CUT_MAX_TOKENS > max(CUT_AFTER) for p in plan if p.group == "cut")


def _out(index: int, kind: str, outcome: str, latency: float = 1.0, status: int | None = None,
         variant: str = "") -> Outcome:
    return Outcome(index, kind, variant, outcome, start=10.0, end=10.0 + latency, status=status)


def test_counts_refusals_and_latency_windows():
    outs = [_out(i, "grpc_stream", "ok", latency=0.1 * (i + 1)) for i in range(30)]
    outs += [_out(30, "grpc_stream", "mismatch"), _out(31, "grpc_cancel", "cut"),
             _out(32, "malformed", "refused_500", status=500, variant="not_json"),
             _out(33, "malformed", "refused_4xx", status=400, variant="missing_max_tokens"),
             _out(34, "malformed", "refused_grpc", variant="zero_max_tokens")]
    assert R.outcome_counts(outs) == {"grpc_cancel": {"cut": 1}, "grpc_stream": {"mismatch": 1, "ok": 30},
                                      "malformed": {"refused_4xx": 1, "refused_500": 1, "refused_grpc": 1}}
    ref = R.refusals(outs)
    assert ref["total"] == 3
    assert ref["by_variant"] == {"missing_max_tokens": {"400": 1}, "not_json": {"500": 1},
                                 "zero_max_tokens": {"refused_grpc": 1}}
    lat = R.latency(outs, 0, 35, 10)  # only "ok" requests count: indices 0-9 and 25-29
    assert lat["first"]["n"] == 10 and lat["first"]["p50_ms"] == pytest.approx(550.0)
    assert lat["last"]["range"] == [25, 35] and lat["last"]["n"] == 5
    assert lat["last"]["p50_ms"] == pytest.approx(2800.0)


def _checkpoint(requests: int, stub_rss: float, idle: bool = True) -> dict:
    procs = [{"name": "tritonserver", "rss_mib": 40.0, "pss_mib": 30.0, "uss_mib": 25.0, "fds": 50, "threads": 60},
             {"name": "triton_python_b", "rss_mib": stub_rss, "pss_mib": stub_rss - 100, "uss_mib": stub_rss - 150,
              "fds": 30, "threads": 11}]
    return {"requests": requests, "elapsed_s": 1.0, "idle": idle,
            "metrics": {"trtforge_kv_blocks_used": 0.0, "trtforge_requests_running": 0.0,
                        "trtforge_requests_waiting": 0.0},
            "memory": {"processes": procs, "rss_mib": 40.0 + stub_rss, "pss_mib": stub_rss - 70}}


def test_memory_rows_and_growth_leave_out_the_warm_up():
    rows = [R.memory_row(_checkpoint(n, rss)) for n, rss in ((0, 300.0), (1000, 400.0), (5000, 420.0))]
    assert rows[1]["server_rss_mib"] == 40.0 and rows[1]["stub_rss_mib"] == 400.0
    assert rows[1]["tree_rss_mib"] == 440.0 and rows[1]["fds"] == 80
    growth = R.growth(rows)  # from 1,000 to 5,000 requests, per 1,000
    assert growth["stub_rss_mib"] == pytest.approx(5.0) and growth["server_rss_mib"] == 0.0
    assert R.growth(rows[:2]) is None


def test_stop_hint_reads_this_stop_only(tmp_path):
    from trtforge.bench.soak import stop_hint

    log = tmp_path / "tritonserver.log"
    assert stop_hint(log) == "see the server log"
    log.write_text('I1 server.cc:345] "Timeout 3: Found 2 live models and 0 in-flight non-inference requests"\n'
                   "Signal (15) received.\n"
                   'I2 server.cc:345] "Timeout 15: Found 1 live models and 0 in-flight non-inference requests"\n'
                   "Signal (11) received.\n")
    assert stop_hint(log) == ("Timeout 15: Found 1 live models and 0 in-flight non-inference requests; "
                              "it crashed (SIGSEGV) while stopping")
