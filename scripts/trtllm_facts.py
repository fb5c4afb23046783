"""Record the interface of TensorRT-LLM's Triton models (one release) as test data.

    python scripts/trtllm_facts.py ALL_MODELS_DIR --release v0.19.0 --commit SHA \
        --source https://github.com/triton-inference-server/tensorrtllm_backend > facts.json

ALL_MODELS_DIR is `all_models/` of a checkout of that release: tensorrtllm_backend up to v0.19.0,
TensorRT-LLM's `triton_backend/all_models` from v0.20 (or `/app/all_models` inside the NGC
image). Written: for each model of `inflight_batcher_llm` and `disaggregated_serving`, its name,
backend/platform, inputs and outputs (name, type, dims, optional, reshape, ragged), its parameter
keys and, for the ensemble, the steps' tensor maps; under "llmapi", the same for the LLM-API
python model and the keys of its model.yaml. No template text is copied. `--model-commit
NAME=SHA` records a model read at another commit than --commit. model_repo/trtllm/ emits from
this record, and tests/model_repo/trtllm/ compares what `emit-repo` writes with its own copy.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from trtforge.model_repo.trtllm.templates import DTYPE_PLACEHOLDERS, ModelFacts, read_template

MODELS = {
    "inflight_batcher_llm": ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
                             "tensorrt_llm_bls"),
    "disaggregated_serving": ("disaggregated_serving_bls",),
}
LLMAPI = "llmapi/tensorrt_llm"


def _record(facts: ModelFacts, template: str, commit: str | None) -> dict:
    out = {"template": template, "backend": facts.backend, "platform": facts.platform,
           "inputs": [t.as_list() for t in facts.inputs],
           "outputs": [t.as_list() for t in facts.outputs],
           "parameters": facts.parameters, "fixed_parameters": facts.fixed, "steps": facts.steps}
    if commit:
        out["commit"] = commit
    return out


def _yaml_keys(path: Path) -> dict:
    """Top-level keys of the LLM-API model.yaml and those of its triton_config section."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    return {"keys": sorted(data), "triton_config_keys": sorted(data.get("triton_config") or {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("all_models", type=Path)
    ap.add_argument("--release", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--source", required=True, help="repository URL the templates come from")
    ap.add_argument("--model-commit", action="append", default=[], metavar="NAME=SHA",
                    help="a model read at another commit (repeatable; llmapi: 'llmapi')")
    args = ap.parse_args()
    commits = dict(item.split("=", 1) for item in args.model_commit)
    used: set[str] = set()
    out: dict = {"release": args.release, "commit": args.commit, "source": args.source,
                 "dtype_placeholders": {}, "models": {}}
    for group, names in MODELS.items():
        for name in names:
            path = args.all_models / group / name / "config.pbtxt"
            used |= set(re.findall(r"\$\{(\w+)\}", path.read_text()))
            out["models"][name] = _record(read_template(path), f"all_models/{group}/{name}/config.pbtxt",
                                          commits.get(name))
    llmapi = args.all_models / LLMAPI
    if (llmapi / "config.pbtxt").is_file():
        used |= set(re.findall(r"\$\{(\w+)\}", (llmapi / "config.pbtxt").read_text()))
        record = _record(read_template(llmapi / "config.pbtxt"), f"all_models/{LLMAPI}/config.pbtxt",
                         commits.get("llmapi"))
        record["model_yaml"] = _yaml_keys(llmapi / "1" / "model.yaml")
        out["llmapi"] = {"tensorrt_llm": record}
    out["dtype_placeholders"] = {k: v for k, v in DTYPE_PLACEHOLDERS.items() if k in used}
    sys.stdout.write(_dumps(out) + "\n")
    return 0


def _dumps(facts: dict) -> str:
    """Indented JSON with one line per tensor, so that a diff between releases reads per tensor."""
    text = json.dumps(facts, indent=1)
    return re.sub(r"\[\n\s*(\"[^\"]*\",\s*\"TYPE_\w+\",[^\]]*\][^\]]*?)\n\s*\]",
                  lambda m: json.dumps(json.loads("[" + m.group(1) + "]")), text)


if __name__ == "__main__":
    sys.exit(main())
