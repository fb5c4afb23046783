"""`trtforge`: the one command line. Sub-commands:

    build            = build-engine (HF checkpoint → engine directory)
    demo-checkpoint  random-weight checkpoint with a real tokenizer (quickstart, tests, benchmarks)
    generate         run prompts through an engine with in-flight batching
    tp-worker        ranks > 0 of a tensor-parallel engine on another host (docs/scale-out.md)
    emit-repo/serve/client    Triton model repository, real tritonserver, tritonclient
    export-onnx/verify-onnx   the TensorRT path's ONNX graph, checked with ONNX Runtime on CPU
    bench            offline and serving benchmarks
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click

from trtforge.cli.build import build_engine, parse_schedule
from trtforge.config.fields import dataclass_options, pick
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.serving.core.scheduler import EngineOverloaded
from trtforge.serving.outputs import FinishReason

_LIST_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if "list" in str(f.type))
_GUIDE_FIELDS = ("guided_decoding_guide_type", "guided_decoding_guide")  # the structured-output flags set them


def _guide(json_schema: str | None, regex: str | None, grammar: str | None, json_object: bool,
           structural_tag: str | None) -> dict[str, str]:
    """The structured-output flags as SamplingParams fields; at most one may be given."""
    given = [(kind, value) for kind, value in (("json_schema", json_schema), ("regex", regex),
                                                ("ebnf_grammar", grammar), ("structural_tag", structural_tag))
             if value is not None]
    if json_object:
        given.append(("json", None))
    if len(given) > 1:
        raise click.UsageError("give at most one of --json-schema, --regex, --grammar, --json-object, "
                               "--structural-tag")
    if not given:
        return {}
    kind, value = given[0]
    if kind in ("json_schema", "ebnf_grammar", "structural_tag"):  # a file: schemas and grammars are long
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {value}: {exc}") from None
    return {"guided_decoding_guide_type": kind, "guided_decoding_guide": value}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trtforge")
def main() -> None:
    """trtforge: Hugging Face checkpoint → paged-KV engine → Triton Inference Server."""


main.add_command(build_engine, "build")


@main.command("demo-checkpoint")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen2", "llama", "gpt2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]),
              default="qwen2", show_default=True)
@click.option("--size", type=click.Choice(["tiny", "0.5b"]), default="tiny", show_default=True,
              help="tiny: 2 layers, hidden 64. 0.5b: Qwen2.5-0.5B's shapes (≈2 GB in float32).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--train-seconds", type=float, default=0.0, show_default=True,
              help="tiny only: fit the random weights to the bundled English text for this long, so "
                   "the demo continues a prompt with its phrases (0: random weights saying random words).")
def demo_checkpoint(directory: str, arch: str, size: str, seed: int, train_seconds: float) -> None:
    """Write a RANDOM-WEIGHT checkpoint (real tokenizer, trained locally) for demos and benchmarks."""
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    try:
        out = write_demo_checkpoint(directory, arch=arch, size=size, seed=seed, train_seconds=train_seconds)
    except BuildError as exc:
        raise click.ClickException(str(exc)) from None
    trained = f", then trained {train_seconds:g} s on the demo text" if train_seconds > 0 else ""
    click.echo(f"random-weight {arch} ({size}) checkpoint{trained} written to {out}")


def _read_prompts(prompts: tuple[str, ...], prompts_file: str | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"prompt": p} for p in prompts]
    if prompts_file:
        with open(prompts_file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise click.ClickException(f"{prompts_file}:{n} is not JSON ({exc.msg}).") from None
                if not isinstance(item, dict) or ("prompt" in item) == ("input_ids" in item):
                    raise click.ClickException(f"{prompts_file}:{n}: each line must be an object with exactly one "
                                               f'of "prompt" or "input_ids" (and optionally "max_tokens").')
                items.append(item)
    if not items:
        raise click.ClickException("no prompts: give --prompt TEXT (repeatable) or --prompts-file F.jsonl.")
    return items


@main.command("generate")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False),
              help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line, optionally with "max_tokens".')
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--bad-word", "bad_words", multiple=True, help="Word never to generate (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt, in input order.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--cuda-graphs", is_flag=True, help="Replay decode steps from CUDA graphs (--device cuda).")
@click.option("--kv-cache-memory", default=None, help="Override the engine's KV budget, e.g. 1GiB.")
@click.option("--schedule", multiple=True, metavar="KEY=VALUE", help="Override a scheduler parameter.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Structured output: every completion is JSON valid against this JSON Schema file.")
@click.option("--regex", metavar="RE", help="Structured output: every completion matches this regular expression.")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Structured output: every completion follows this EBNF grammar file (rule `root`).")
@click.option("--json-object", is_flag=True, help="Structured output: every completion is a JSON object.")
@click.option("--structural-tag", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Structured output: xgrammar's structural-tag JSON, from this file.")
@dataclass_options(SamplingParams,
                   exclude=_LIST_FIELDS + _GUIDE_FIELDS + ("skip_special_tokens", "include_stop_str_in_output"))
def generate(engine_dir: str, prompts: tuple[str, ...], prompts_file: str | None, stop: tuple[str, ...],
             bad_words: tuple[str, ...], as_json: bool, device: str, cuda_graphs: bool, kv_cache_memory: str | None,
             schedule: tuple[str, ...], json_schema: str | None, regex: str | None, grammar: str | None,
             json_object: bool, structural_tag: str | None, **sampling: Any) -> None:
    """Generate completions for all prompts together on the paged KV cache (greedy by default)."""
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.serving.engine import LLMEngine

    items = _read_prompts(prompts, prompts_file)
    guide = _guide(json_schema, regex, grammar, json_object, structural_tag)
    try:
        base = SamplingParams(**pick(SamplingParams, sampling), stop=list(stop), bad_words=list(bad_words),
                              **guide)
        runtime = RuntimeConfig(device=device, kv_cache_memory=kv_cache_memory, cuda_graphs=cuda_graphs)
        engine = LLMEngine.from_engine_dir(engine_dir, runtime, **parse_schedule(schedule))
        params = [dataclasses.replace(base, max_tokens=int(it.get("max_tokens", base.max_tokens))) for it in items]
        outs = engine.generate([it.get("prompt", it.get("input_ids")) for it in items], params)
    except (BuildError, ValueError, EngineOverloaded) as exc:
        raise click.ClickException(str(exc)) from None
    # a failed step, e.g. a tensor-parallel rank died
    failed = [out.error for out in outs if out.finish_reason == FinishReason.ERROR]
    for i, out in enumerate(outs):
        if as_json:
            click.echo(json.dumps({"index": i, "output_ids": out.output_token_ids, "text": out.text,
                                   "finish_reason": out.finish_reason}, ensure_ascii=False))
        else:
            click.echo(f"--- [{i}] ({len(out.output_token_ids)} tokens, {out.finish_reason})")
            click.echo(out.text)
    if failed:
        raise click.ClickException(failed[0])


@main.command("tp-worker")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--device", default="cpu", show_default=True, help="cpu (gloo) or cuda (NCCL; GPU = LOCAL_RANK).")
def tp_worker(engine_dir: str, device: str) -> None:
    """Run ranks > 0 of a tensor-parallel engine on this host (docs/scale-out.md): with RANK/WORLD_SIZE,
    or NNODES/NODE_RANK, and MASTER_ADDR/MASTER_PORT of rank 0's host, which runs `trtforge generate`,
    `trtforge bench offline` or the Triton model on the same engine."""
    from trtforge.serving.worker.tp_worker import main as worker_main

    sys.exit(worker_main([engine_dir, "--device", device]))


def _add_optional_commands() -> None:
    """Sub-commands living next to what they drive: ONNX/TensorRT (builder), benchmarks (here), and
    the Triton side (model_repo, a later stage: reached only from this entry point, lazily)."""
    from trtforge.cli.bench import bench
    from trtforge.cli.dynamo import dynamo_worker_command
    from trtforge.cli.onnx import export_onnx_cmd, verify_onnx_cmd
    from trtforge.cli.triton import client_command, emit_repo_command, serve_command

    for cmd in (emit_repo_command, serve_command, client_command, export_onnx_cmd, verify_onnx_cmd, bench,
                dynamo_worker_command):
        main.add_command(cmd)


_add_optional_commands()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
