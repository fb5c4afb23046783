"""`trtforge --help` (and every command's registration) imports no heavy library: start-up in
well under a second. Commands import what they drive inside their bodies."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "numpy", "transformers", "tritonclient", "onnx", "onnxruntime", "safetensors")


def test_cli_registration_imports_nothing_heavy():
    code = ("import sys; import trtforge.cli.main; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
