"""End-to-end fixtures: a tiny engine built with the CLI, served by a real tritonserver.

The session builds `trtforge demo-checkpoint` → `build-engine` → `trtforge emit-repo`, starts tritonserver
on free ports (explicit model control, so a test can ask it to load a misconfigured copy of the
model), and stops it at the end. `TRTFORGE_E2E_ENGINE=DIR` reuses an engine built earlier with
the same flags (faster iteration; the repository is still emitted and served fresh).

No e2e test may skip or vanish silently: `pytest_sessionfinish` fails the run when an e2e test
that was selected did not pass, or when a whole e2e module ran fewer tests than it declares in
`EXPECTED_TESTS`.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.helpers import BUILD_FLAGS, run_cli

EXPECTED_TESTS = {"test_triton_e2e.py": 11, "test_launcher.py": 2, "test_openai.py": 14,
                  "test_openai_fuzz.py": 1, "test_disaggregated.py": 7,
                  "test_tensor_parallel_e2e.py": 1, "test_disaggregated_hosts.py": 2, "test_dynamo.py": 6,
                  "test_dynamo_disaggregated.py": 4, "test_openai_disaggregated.py": 2,
                  "test_openai_tools.py": 5, "test_worker_router.py": 4, "test_openai_tokenize_tools.py": 1,
                  "test_speculative_e2e.py": 3}

_selected: Counter = Counter()
_passed: Counter = Counter()
_not_passed: list[str] = []


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).name


def pytest_collection_finish(session):
    for item in session.items:  # after -m/-k/--deselect filtering
        # Only this folder's modules: e2e tests elsewhere (TensorRT-LLM's python models) may skip
        # where what they need is missing, saying so.
        if item.get_closest_marker("e2e") and _module(item.nodeid) in EXPECTED_TESTS:
            _selected[_module(item.nodeid)] += 1


def pytest_runtest_logreport(report):
    if _module(report.nodeid) not in EXPECTED_TESTS:
        return
    if report.when == "call" and report.passed:
        _passed[_module(report.nodeid)] += 1
    elif report.skipped or report.failed:
        _not_passed.append(f"{report.nodeid} ({report.outcome} in {report.when})")


def pytest_sessionfinish(session, exitstatus):
    problems = list(_not_passed)
    for module, n in _selected.items():
        if n != _passed[module]:
            problems.append(f"{module}: {_passed[module]} of {n} selected e2e tests passed")
    # A -k filter, --lf or a node id selects part of a module on purpose.
    full = (not session.config.getoption("keyword") and not session.config.getoption("lf")
            and not any("::" in str(arg) for arg in session.config.args))
    named = {Path(str(a)).name for a in session.config.args} & set(EXPECTED_TESTS)
    # Modules that must have run in full: those named on the command line, else all of them
    # as soon as any e2e test was selected (a module that vanished is caught too).
    required = named or (set(EXPECTED_TESTS) if _selected else set())
    for module in sorted(required) if full else []:
        if _selected[module] != EXPECTED_TESTS[module]:
            problems.append(f"{module}: {_selected[module]} tests collected, "
                            f"{EXPECTED_TESTS[module]} expected")
    if problems:
        print("\nE2E COUNT CHECK FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("TRTFORGE_E2E_ENGINE")
    if reuse:
        return Path(reuse)
    root = tmp_path_factory.mktemp("e2e")
    run_cli("trtforge", "demo-checkpoint", str(root / "ckpt"), "--arch", "qwen2", "--size", "tiny")
    run_cli("build-engine", str(root / "ckpt"), "--output", str(root / "engine"), "-q",
            *BUILD_FLAGS)
    return root / "engine"
