"""`trtforge generate`: run prompts through an engine with in-flight batching (greedy by default),
with speculative decoding when the engine was built with a default (engine.json) or
--speculative-config asks for it (`--speculative-config none` turns a default off;
docs/speculative-decoding.md)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from trtforge.cli.build import parse_schedule
from trtforge.config.fields import dataclass_options, pick
from trtforge.config.runtime import RuntimeConfig
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


@click.command("generate")
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
@click.option("--speculative-config", default=None, metavar="JSON",
              help=RuntimeConfig.field_docs()["speculative_config"])
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
             schedule: tuple[str, ...], speculative_config: str | None, json_schema: str | None, regex: str | None,
             grammar: str | None, json_object: bool, structural_tag: str | None, **sampling: Any) -> None:
    """Generate completions for all prompts together on the paged KV cache (greedy by default)."""
    from trtforge.serving.engine import LLMEngine

    items = _read_prompts(prompts, prompts_file)
    guide = _guide(json_schema, regex, grammar, json_object, structural_tag)
    try:
        base = SamplingParams(**pick(SamplingParams, sampling), stop=list(stop), bad_words=list(bad_words),
                              **guide)
        runtime = RuntimeConfig(device=device, kv_cache_memory=kv_cache_memory, cuda_graphs=cuda_graphs,
                                speculative_config=speculative_config)
        engine = LLMEngine.from_engine_dir(engine_dir, runtime, **parse_schedule(schedule))
        params = [dataclasses.replace(base, max_tokens=int(it.get("max_tokens", base.max_tokens))) for it in items]
        outs = engine.generate([it.get("prompt", it.get("input_ids")) for it in items], params)
    except (BuildError, ValueError, EngineOverloaded) as exc:
        raise click.ClickException(str(exc)) from None
    # a failed step, e.g. a tensor-parallel rank died
    failed = [out.error for out in outs if out.finish_reason == FinishReason.ERROR]
    for i, out in enumerate(outs):
        if as_json:
            record = {"index": i, "output_ids": out.output_token_ids, "text": out.text,
                      "finish_reason": out.finish_reason}
            if engine.spec is not None:  # speculative decoding (flag or engine.json): the request's acceptance
                record.update(num_draft_tokens=out.num_draft_tokens, num_accepted_tokens=out.num_accepted_tokens)
            click.echo(json.dumps(record, ensure_ascii=False))
        else:
            click.echo(f"--- [{i}] ({len(out.output_token_ids)} tokens, {out.finish_reason})")
            click.echo(out.text)
    if failed:
        raise click.ClickException(failed[0])
