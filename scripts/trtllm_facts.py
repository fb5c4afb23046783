"""Record the interface of TensorRT-LLM's Triton models (one release) as test data.

    python scripts/trtllm_facts.py ALL_MODELS_DIR --release v0.19.0 --commit SHA \
        --source https://github.com/triton-inference-server/tensorrtllm_backend > facts.json

ALL_MODELS_DIR is `all_models/` of a checkout of that release (or `/app/all_models` inside the
NGC image). Written: for each model of `inflight_batcher_llm` and `disaggregated_serving`, its
name, backend/platform, inputs and outputs (name, type, dims, optional, reshape, ragged), its
parameter keys and, for the ensemble, the steps' tensor maps. No template text is copied.
tests/model_repo/trtllm/ compares what `emit-repo` writes with this record.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from trtforge.model_repo.trtllm.templates import DTYPE_PLACEHOLDERS, read_template

MODELS = {
    "inflight_batcher_llm": ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
                             "tensorrt_llm_bls"),
    "disaggregated_serving": ("disaggregated_serving_bls",),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("all_models", type=Path)
    ap.add_argument("--release", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--source", required=True, help="repository URL the templates come from")
    args = ap.parse_args()
    out: dict = {"release": args.release, "commit": args.commit, "source": args.source,
                 "dtype_placeholders": DTYPE_PLACEHOLDERS, "models": {}}
    for group, names in MODELS.items():
        for name in names:
            path = args.all_models / group / name / "config.pbtxt"
            facts = read_template(path)
            out["models"][name] = {
                "template": f"all_models/{group}/{name}/config.pbtxt",
                "backend": facts.backend, "platform": facts.platform,
                "inputs": [t.as_list() for t in facts.inputs],
                "outputs": [t.as_list() for t in facts.outputs],
                "parameters": facts.parameters, "fixed_parameters": facts.fixed,
                "steps": facts.steps}
    sys.stdout.write(_dumps(out) + "\n")
    return 0


def _dumps(facts: dict) -> str:
    """Indented JSON with one line per tensor, so that a diff between releases reads per tensor."""
    text = json.dumps(facts, indent=1)
    return re.sub(r"\[\n\s*(\"[^\"]*\",\s*\"TYPE_\w+\",[^\]]*\][^\]]*?)\n\s*\]",
                  lambda m: json.dumps(json.loads("[" + m.group(1) + "]")), text)


if __name__ == "__main__":
    sys.exit(main())
