"""Record what GPTQModel (the GPTQ / AWQ checkpoints' own package) dequantises the test checkpoints to.

gptqmodel does not install next to this project's pinned CPU torch (it asks for a newer one), so it runs
in a separate virtual environment that sees this project's packages, and its results are stored:

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install --no-deps gptqmodel==7.7.0 compressed-tensors==0.20.1
    /tmp/oracle-venv/bin/pip install pypcre logbar accelerate threadpoolctl device-smi tokenicer defuser
    echo 'import site; site.addsitedir("'$PWD'/.venv/lib/python3.11/site-packages")' \\
        > /tmp/oracle-venv/lib/python3.11/site-packages/project_site.pth
    /tmp/oracle-venv/bin/python -m tests.builder.prequantized_oracle   # writes tests/builder/data/...

For every GPTQ and AWQ case of prequantized_checkpoints.py it writes the sha256 of each dequantised decoder
weight: GPTQ through gptqmodel.utils.model_dequant.dequantize_model (its checkpoint dequantiser: v1 zero
offset, g_idx), AWQ through gptqmodel's AWQ GEMM dequantiser `dequantize_gemm` (what its torch AWQ kernel
runs: the nibble interleave). test_prequantized_gptq_awq.py compares trtforge's codes with these.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.builder.prequantized_checkpoints import CASES, make_prequantized

OUT = Path(__file__).with_name("data") / "prequantized_oracle.json"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _gptq(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from gptqmodel.utils.model_dequant import dequantize_model

    dequantize_model(ckpt, tmp / "dequantized", target_dtype=torch.float32)
    return load_file(str(tmp / "dequantized" / "model.safetensors"))


def _awq(ckpt: Path, group: int) -> dict[str, torch.Tensor]:
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    t = load_file(str(ckpt / "model.safetensors"))
    return {m[: -len(".qweight")] + ".weight": dequantize_gemm(t[m], t[m[:-7] + "qzeros"], t[m[:-7] + "scales"], 4,
                                                                group).t().contiguous()
            for m in t if m.endswith(".qweight")}


def main() -> None:
    import gptqmodel

    record: dict = {"gptqmodel": gptqmodel.__version__, "torch": torch.__version__, "cases": {}}
    for case, spec in CASES.items():
        if spec["fmt"] not in ("gptq", "awq"):
            continue
        with tempfile.TemporaryDirectory() as d:
            ckpt = make_prequantized(Path(d) / "ckpt", case)
            weights = _gptq(ckpt, Path(d)) if spec["fmt"] == "gptq" else _awq(ckpt, spec["group"])
            names = load_file(str(ckpt / "model.safetensors"))
            packed = {k[: -len(".qweight")] for k in names if k.endswith("qweight")}
        record["cases"][case] = {f"{m}.weight": {"dtype": str(weights[f"{m}.weight"].dtype).replace("torch.", ""),
                                                 "sha256": digest(weights[f"{m}.weight"])} for m in sorted(packed)}
        print(case, len(packed), "layers")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
