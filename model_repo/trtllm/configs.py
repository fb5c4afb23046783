"""Typed ModelConfig messages of the trtllm repository's models (TensorRT-LLM's interface).

The tensors and ensemble maps come from the recorded upstream interface of the release written
for (upstream.py); the parameters from values.py. Batching and instance fields follow upstream's templates, filled:
the tensorrt_llm model runs one instance (the executor batches in flight) on KIND_CPU (the
backend places the engine on the GPUs itself); the python models run `instance_count` each.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from trtforge.builder.trtllm.versions import TrtllmRelease
from trtforge.model_repo.trtllm import upstream as U
from trtforge.model_repo.trtllm.templates import Tensor
from trtforge.model_repo.trtllm.values import TrtllmRepoOptions


def model_input(t: Tensor) -> mc.ModelInput:
    io = mc.ModelInput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=list(t.dims),
                       optional=t.optional, allow_ragged_batch=t.ragged)
    if t.reshape is not None:
        io.reshape.SetInParent()  # `reshape: { shape: [ ] }`: an empty shape still counts
        io.reshape.shape.extend(t.reshape)
    return io


def model_output(t: Tensor) -> mc.ModelOutput:
    return mc.ModelOutput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=list(t.dims))


def _params(values: dict[str, str]) -> dict[str, mc.ModelParameter]:
    return {k: mc.ModelParameter(string_value=v) for k, v in sorted(values.items())}


def _interface(upstream_model: str, release: TrtllmRelease, group: str = "models") -> dict:
    return {"input": [model_input(t) for t in U.tensors(upstream_model, "inputs", release, group)],
            "output": [model_output(t) for t in U.tensors(upstream_model, "outputs", release, group)]}


def _cpu_instances(count: int) -> list[mc.ModelInstanceGroup]:
    return [mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=count)]


def _queue(opts: TrtllmRepoOptions, max_queue_size: int) -> mc.ModelDynamicBatching:
    return mc.ModelDynamicBatching(
        preferred_batch_size=[opts.triton_max_batch_size],
        max_queue_delay_microseconds=opts.max_queue_delay_microseconds,
        default_queue_policy=mc.ModelQueuePolicy(max_queue_size=max_queue_size))


def tensorrt_llm_config(name: str, opts: TrtllmRepoOptions, max_queue_size: int,
                        parameters: dict[str, str], release: TrtllmRelease) -> mc.ModelConfig:
    """The C++ `tensorrtllm` backend model (also the context/generation phases, by name)."""
    return mc.ModelConfig(
        name=name, backend="tensorrtllm", max_batch_size=opts.triton_max_batch_size,
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=opts.decoupled),
        dynamic_batching=_queue(opts, max_queue_size), instance_group=_cpu_instances(1),
        parameters=_params(parameters), **_interface("tensorrt_llm", release))


def preprocessing_config(opts: TrtllmRepoOptions, max_queue_size: int,
                         parameters: dict[str, str], release: TrtllmRelease) -> mc.ModelConfig:
    return mc.ModelConfig(
        name="preprocessing", backend="python", max_batch_size=opts.triton_max_batch_size,
        dynamic_batching=_queue(opts, max_queue_size),
        instance_group=_cpu_instances(opts.instance_count), parameters=_params(parameters),
        **_interface("preprocessing", release))


def postprocessing_config(opts: TrtllmRepoOptions, parameters: dict[str, str],
                          release: TrtllmRelease) -> mc.ModelConfig:
    return mc.ModelConfig(
        name="postprocessing", backend="python", max_batch_size=opts.triton_max_batch_size,
        dynamic_batching=mc.ModelDynamicBatching(),
        instance_group=_cpu_instances(opts.instance_count), parameters=_params(parameters),
        **_interface("postprocessing", release))


def bls_config(model: str, opts: TrtllmRepoOptions, parameters: dict[str, str],
               release: TrtllmRelease) -> mc.ModelConfig:
    """tensorrt_llm_bls or disaggregated_serving_bls (decoupled python models)."""
    return mc.ModelConfig(
        name=model, backend="python", max_batch_size=opts.triton_max_batch_size,
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=opts.decoupled),
        instance_group=_cpu_instances(opts.instance_count), parameters=_params(parameters),
        **_interface(model, release))


def ensemble_config(opts: TrtllmRepoOptions, release: TrtllmRelease,
                    llm_model: str = "tensorrt_llm") -> mc.ModelConfig:
    """The `ensemble` (platform "ensemble"): preprocessing → `llm_model` → postprocessing.
    A disaggregated repository puts disaggregated_serving_bls where tensorrt_llm was, as
    upstream's disaggregated serving README says."""
    steps = []
    for step in U.ensemble_steps(release):
        model = llm_model if step["model_name"] == "tensorrt_llm" else step["model_name"]
        steps.append(mc.ModelEnsembling.Step(model_name=model, model_version=-1,
                                             input_map=step["input_map"],
                                             output_map=step["output_map"]))
    return mc.ModelConfig(name="ensemble", platform="ensemble",
                          max_batch_size=opts.triton_max_batch_size,
                          ensemble_scheduling=mc.ModelEnsembling(step=steps),
                          **_interface("ensemble", release))
