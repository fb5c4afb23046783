"""Fixtures shared by the test packages."""

from __future__ import annotations

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
