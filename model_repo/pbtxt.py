"""config.pbtxt files and model directories: typed ModelConfig messages, their text, writing them.

What every emitter (emit.py, disaggregated.py, trtllm/emit.py) and every reader of a repository
(the OpenAI front end, the tests) share. Configs are typed protobuf (`model_config_pb2.ModelConfig`)
written with `text_format`; nothing is a template with placeholders.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtforge.model_repo.interface import INPUTS, OUTPUTS, TensorSpec


def model_inputs(specs: tuple[TensorSpec, ...]) -> list[mc.ModelInput]:
    return [mc.ModelInput(name=s.name, data_type=mc.DataType.Value(s.dtype), dims=list(s.dims),
                          optional=s.optional) for s in specs]


def model_outputs(specs: tuple[TensorSpec, ...]) -> list[mc.ModelOutput]:
    return [mc.ModelOutput(name=s.name, data_type=mc.DataType.Value(s.dtype), dims=list(s.dims))
            for s in specs]


def python_model_config(name: str, parameters: dict[str, str], max_batch_size: int) -> mc.ModelConfig:
    """A decoupled python model with the `ensemble` interface (the engine model, or the router).

    One instance (the engine batches; the router's threads route); KIND_CPU because the python
    backend process itself needs no GPU (the engine picks its device from the `device` parameter)."""
    return mc.ModelConfig(
        name=name,
        backend="python",
        max_batch_size=max_batch_size,
        input=model_inputs(INPUTS),
        output=model_outputs(OUTPUTS),
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        parameters={k: mc.ModelParameter(string_value=v) for k, v in parameters.items()},
    )


def config_text(config: mc.ModelConfig, header: list[str] = ()) -> str:
    """config.pbtxt text: `#` comment lines (ignored by the parser) then the typed message."""
    lines = [f"# {h}".rstrip() for h in header]
    return "\n".join(lines + [text_format.MessageToString(config)])


def read_config(path: str | os.PathLike) -> mc.ModelConfig:
    """Parse a config.pbtxt back into a ModelConfig (raises text_format.ParseError)."""
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def parameters_of(config: mc.ModelConfig) -> dict[str, str]:
    """{name: string_value} of a model config's parameters."""
    return {k: v.string_value for k, v in config.parameters.items()}


def write_model(repo: Path, name: str, config: str, files: dict[str, Path]) -> None:
    """Write model `name` (config.pbtxt text, and `files` {path under 1/: source} copied): built
    beside its final place, then swapped in (never half-written)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=repo))
    try:
        (tmp / "1").mkdir()
        (tmp / "config.pbtxt").write_text(config + "\n")
        for dest, src in files.items():
            (tmp / "1" / dest).parent.mkdir(parents=True, exist_ok=True)  # e.g. lib/decode.py
            shutil.copyfile(src, tmp / "1" / dest)
        target = repo / name
        if target.exists():
            shutil.rmtree(target)
        tmp.chmod(0o755)  # mkdtemp makes it private; the server may run as another user
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
