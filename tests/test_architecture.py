"""The architecture contract: config, plugins <- models <- builder <- serving <- model_repo <- frontend,
bench <- cli; config and serving.core free of torch.

The contract lives in pyproject.toml ([tool.importlinter]) and is checked with import-linter. Besides
checking the tree as it is, the tests plant a forbidden import in a copy of the packages and show
that the contract catches it: a check that cannot fail would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
STAGES = ("config", "plugins", "models", "builder", "serving", "model_repo", "frontend", "dynamo_backend", "bench",
          "cli")


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:  # a copy of the packages shadows the editable install
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_the_contract():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture()
def package_copy(tmp_path: Path) -> Path:
    """tmp/trtforge/<stage> copies of the stages (no __pycache__)."""
    for stage in STAGES:
        shutil.copytree(ROOT / stage, tmp_path / "trtforge" / stage,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


@pytest.mark.parametrize("module, line, broken", [
    ("plugins/paged_attention/reference.py", "import trtforge.serving.engine",
     "trtforge.plugins.paged_attention.reference -> trtforge.serving.engine"),
    ("models/engine_dir.py", "from trtforge.builder import checkpoint",
     "trtforge.models.engine_dir -> trtforge.builder.checkpoint"),
    ("model_repo/emit.py", "from trtforge.frontend import server",
     "trtforge.model_repo.emit -> trtforge.frontend.server"),
    ("frontend/server.py", "from trtforge.bench import serve",
     "trtforge.frontend.server -> trtforge.bench.serve"),
    ("config/scheduler.py", "import torch", "trtforge.config.scheduler -> torch"),
    ("serving/core/sequence.py", "import torch", "trtforge.serving.core.sequence -> torch"),
])
def test_a_reversed_import_breaks_the_contract(package_copy: Path, module: str, line: str, broken: str):
    control = _lint(package_copy, pythonpath=package_copy)
    assert control.returncode == 0, "the unmodified copy must pass: " + control.stdout + control.stderr
    target = package_copy / "trtforge" / module
    target.write_text(target.read_text() + f"\n{line}  # planted by the test\n")
    result = _lint(package_copy, pythonpath=package_copy)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and broken in result.stdout, result.stdout
