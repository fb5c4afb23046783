"""Fixtures shared by the test packages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spin-waiting made each tiny matmul ~50x slower; one thread keeps these modules fast."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_TESTS = Path(__file__).parent


def pytest_collection_finish(session):
    """A whole-suite run collects every test file on disk: a plugin's pytest_ignore_collect hook
    (ai-dynamo's dropped every file named *triton* / *trtllm*) or a broken conftest must not make
    tests vanish without a word. Runs that name files, -k or --lf are left alone."""
    config = session.config
    whole = (not config.getoption("keyword") and not config.getoption("lf")
             and [Path(str(a)).resolve() for a in config.args] in ([_TESTS.resolve()], [_TESTS.parent.resolve()]))
    if not whole:
        return
    collected = {Path(str(item.path)).resolve() for item in session.items}
    # a file whose every test is deselected or parametrized away would be collected with 0 items: none here
    missing = sorted(str(p.relative_to(_TESTS)) for p in _TESTS.rglob("test_*.py")
                     if p.resolve() not in collected)
    if missing:
        raise pytest.UsageError(f"{len(missing)} test files were not collected (a plugin or conftest ignored them): "
                                + ", ".join(missing[:20]))
