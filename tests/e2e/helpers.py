"""Helpers shared by the e2e tests: this environment's console scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
"""Where `trtforge` and `build-engine` of the running environment live."""
BUILD_FLAGS = ["--dtype", "float32", "--max-batch-size", "32", "--max-num-tokens", "256",
               "--max-seq-len", "2048", "--kv-block-size", "8", "--kv-cache-memory", "8MiB"]
"""build-engine flags of the e2e engine (TRTFORGE_E2E_ENGINE must be built with the same). A long
max_seq_len keeps the longest answers running ~1 s, long enough for a test to cancel one in the
middle: with 256 the tiny engine finished all of them in ~0.15 s and the cancel tests raced it."""


def run_cli(*args: str, timeout: int = 300) -> None:
    """Run a console script of this environment; fail the test with its output if it fails."""
    proc = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def fail_alone(bad: list, good: list, expected: list[str]) -> None:
    """Run bad requests (callables, each with the error it must raise) and good ones at once: each
    bad one fails with its message, every good one returns its expected text."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        good_futures = [pool.submit(fn) for fn in good]
        bad_futures = [(pool.submit(fn), why) for fn, why in bad]
        for future, why in bad_futures:
            with pytest.raises(RuntimeError, match=why):
                future.result()
        assert [f.result() for f in good_futures] == expected


def engine_with_chat_template(engine_dir: Path, root: Path, template: Path) -> Path:
    """A copy of `engine_dir` under `root` whose tokenizer carries `template` as its chat template (engine.json's
    digests rewritten to match), emitted as the Triton repository `root / "repo"`; returns the engine copy."""
    import json
    import shutil

    from trtforge.models.engine_dir import read_engine_config, write_engine_json

    engine = root / "qwen-template"
    shutil.copytree(engine_dir, engine)
    (engine / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((engine / "tokenizer_config.json").read_text())
    config["chat_template"] = template.read_text()
    (engine / "tokenizer_config.json").write_text(json.dumps(config))
    write_engine_json(engine, read_engine_config(engine, verify_checksums=False))  # the new digests
    run_cli("trtforge", "emit-repo", str(engine), str(root / "repo"))
    return engine
