"""Packaging and repository hygiene: the wheel installs only under `trtforge/`, the Dockerfile and the
shell scripts are lint-clean (hadolint / shellcheck from PyPI wheels listed in the dev extra)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_wheel_has_no_generic_top_level_names(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("trtforge-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"trtforge", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("trtforge/models/network.py", "trtforge/config/scheduler.py",
                   "trtforge/plugins/paged_attention/op.py", "trtforge/serving/engine.py",
                   "trtforge/serving/core/scheduler.py",
                   "trtforge/model_repo/emit.py", "trtforge/model_repo/python_models/engine.py",
                   "trtforge/model_repo/python_models/router.py", "trtforge/frontend/server.py",
                   "trtforge/dynamo_backend/worker.py",
                   "trtforge/bench/offline.py", "trtforge/cli/main.py",
                   # the native CPU kernels' sources, built at first use
                   "trtforge/plugins/cpu/fused.c", "trtforge/plugins/cpu/linear.c",
                   "trtforge/plugins/native_vec.h", "trtforge/plugins/paged_attention/cpu_decode.c",
                   # the demo checkpoint's English text (its tokenizer is trained on it)
                   "trtforge/builder/demo_corpus.txt"):
        assert module in names
    assert not any(n.startswith("trtforge/__init__") for n in names), "trtforge must stay a namespace package"


def test_generic_names_not_importable_outside_the_repo():
    stages = ("config", "models", "builder", "serving", "plugins", "model_repo", "frontend", "dynamo_backend", "bench",
              "cli")
    code = ("import importlib.util, sys; import trtforge.serving.engine; "
            f"sys.exit(any(importlib.util.find_spec(m) for m in {stages!r}))")
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dockerfile_is_lint_clean():
    result = subprocess.run([str(BIN / "hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _copy_sources(dockerfile: Path) -> list[str]:
    """Build-context paths of every COPY/ADD (line continuations joined; --from=stage copies skipped)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    sources = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources += args[:-1]  # the last argument is the destination
    return sources


def test_dockerfile_copies_only_what_exists():
    """hadolint cannot see a missing build-context path, and the image cannot be built here: a COPY
    of a folder that does not exist would only fail on `docker build`."""
    sources = _copy_sources(ROOT / "Dockerfile")
    assert {"config", "plugins", "models", "builder", "serving", "model_repo", "frontend", "bench", "cli",
            "pyproject.toml"} <= set(sources)
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"Dockerfile COPYs paths that are not in the repository: {missing}"


def test_shell_scripts_are_lint_clean():
    scripts = sorted(str(p) for p in [*ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"])
    result = subprocess.run([str(BIN / "shellcheck"), *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
