"""summary.txt for scripts/device_check.sh: step outcomes plus the headline numbers.

    python scripts/gpu/summarize.py OUT_DIR > OUT_DIR/summary.txt

Reads only what the steps left behind (steps.tsv, junit XML, JSON reports); a missing or broken
file becomes a line saying so, never an exception.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def steps(out: Path) -> list[str]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    return [f"  {name:18s} {status:12s} {secs:>5s}s  {log}" for name, status, secs, log in rows]


def junit(out: Path, name: str) -> str:
    path = out / name
    if not path.exists():
        return f"  {name}: not written"
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return f"  {name}: unreadable ({exc})"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors",
                                                                  "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    line = (f"  {name}: {total['tests']} tests, {total['failures']} failed, "
            f"{total['errors']} errors, {total['skipped']} skipped")
    return "\n".join([line] + [f"    FAILED {f}" for f in failed[:20]])


def load(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def bandwidth(out: Path) -> list[str]:
    data = load(out, "decode_attention_bandwidth.json")
    if data is None:
        return ["  decode_attention_bandwidth.json: not written"]
    lines = [f"  copy bandwidth {data['copy_gb_s']:.0f} GB/s; default config reaches >= "
             f"{100 * data['target_fraction']:.0f}% everywhere: "
             f"{'YES' if data['meets_target'] else 'NO'}"]
    for r in data["rows"]:
        if r["num_kv_splits"] == "auto" and r["tile_n"] == "auto":
            lines.append(f"    ctx {r['context']:6d} batch {r['batch']:4d}: {r['gb_s']:7.0f} GB/s "
                         f"= {100 * r['fraction_of_copy']:5.1f}% (max err vs torch "
                         f"{r.get('max_abs_err_vs_torch', float('nan')):.2e})")
    for ctx, r in data["best_per_context"].items():
        lines.append(f"    best at ctx {ctx}: splits={r['num_kv_splits']} tile={r['tile_n']} "
                     f"warps={r['num_warps']} {100 * r['fraction_of_copy']:.1f}%")
    return lines


def e2e(out: Path) -> list[str]:
    data = load(out, "e2e_decode.json")
    if data is None:
        return ["  e2e_decode.json: not written"]
    lines = [f"  {data['size']} {data['dtype']}, target {data['target']}: "
             f"{'MET' if data['meets_target'] else 'NOT MET'}"]
    for r in data["rows"]:
        lines.append(f"    batch {r['batch']:3d}: HF {r['hf_tok_s']:8.1f} tok/s, trtforge "
                     f"{r['trtforge_tok_s']:8.1f} tok/s, {r['speedup']:.2f}x")
    return lines


def parity(out: Path) -> list[str]:
    found = sorted(out.glob("parity_*.json"))
    if not found:
        return ["  parity_<device>.json: not written"]
    lines = []
    for path in found:
        data = load(out, path.name) or {}
        for r in data.get("results", []):
            lines.append(f"  {path.name} {r['arch']}: {r['prompts'] - len(r['mismatches'])}/"
                         f"{r['prompts']} prompts token-identical to HF")
    return lines or [f"  {found[0].name}: unreadable"]


def main(out: Path) -> int:
    sections = [
        ("steps", lambda: steps(out)),
        ("kernel + op tests", lambda: [junit(out, "kernel_tests.xml")]),
        ("parity with HF", lambda: [junit(out, "parity_tests.xml")] + parity(out)),
        ("decode attention bandwidth", lambda: bandwidth(out)),
        ("end-to-end decode throughput", lambda: e2e(out)),
        ("TensorRT backend (--backend tensorrt)", lambda: [junit(out, "tensorrt_tests.xml")]),
        ("TensorRT-LLM backend (--backend trtllm)", lambda: [junit(out, "trtllm_tests.xml")]),
    ]
    for title, make in sections:
        print(f"# {title}")
        try:
            print("\n".join(make()))
        except Exception as exc:  # noqa: BLE001 - a report with a hole beats no report
            print(f"  could not summarise: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
