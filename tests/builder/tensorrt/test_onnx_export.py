"""Export each family's tiny engine to ONNX and check it against the torch engine on CPU."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import helper

from trtforge.builder.tensorrt.onnx_export import check_graph, input_names, output_names
from trtforge.builder.tensorrt.onnx_verify import verify
from trtforge.cli.onnx import export_onnx_cmd, verify_onnx_cmd
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.errors import BuildError
from trtforge.models.loader import load_network
from trtforge.plugins.paged_attention.names import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION, QUALIFIED_NAME

ARCHS = ("llama", "qwen2", "qwen3", "gpt2")  # as in conftest.py


@pytest.fixture(scope="module")
def exported(engine_dirs, tmp_path_factory) -> dict[str, object]:
    """arch -> export-onnx output directory (exported once per module)."""
    out = {}
    for arch in ARCHS:
        target = tmp_path_factory.mktemp(f"{arch}-onnx")
        result = CliRunner().invoke(export_onnx_cmd, [str(engine_dirs[arch]), str(target)])
        assert result.exit_code == 0, result.output
        out[arch] = target
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_has_one_plugin_node_per_layer_and_nothing_else_custom(arch, engine_dirs, exported):
    path = exported[arch] / "rank0.onnx"
    head_dim = read_engine_config(engine_dirs[arch]).model.head_dim
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    num_layers = int({p.key: p.value for p in model.metadata_props}["trtforge.num_layers"])
    plugin_nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert len(plugin_nodes) == num_layers == 2
    assert {n.op_type for n in plugin_nodes} == {OP_TYPE}
    assert all(n.domain in ("", DOMAIN) for n in model.graph.node)
    for node in plugin_nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
        assert attrs["plugin_version"] == PLUGIN_VERSION.encode()
        assert attrs["scale"] == pytest.approx(head_dim ** -0.5)
        assert len(node.output) == 2  # attention output + present KV
    assert [i.name for i in model.graph.input] == input_names(num_layers)
    assert [o.name for o in model.graph.output] == output_names(num_layers)
    # Token, sequence and pool dimensions are symbolic: one graph for every step shape.
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}
    assert isinstance(dims["input_ids"][0], str) and isinstance(dims["kv_cache_0"][1], str)
    assert dims["kv_cache_0"][0] == 2 and dims["kv_cache_0"][2] == 4  # K/V, block size
    # Strongly typed: the KV pool dtype is baked in.
    assert model.graph.input[-1].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert check_graph(path, num_layers)[QUALIFIED_NAME] == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_onnx_agrees_with_torch_engine(arch, exported):
    result = CliRunner().invoke(verify_onnx_cmd, [str(exported[arch])])
    assert result.exit_code == 0, result.output
    assert "-> OK" in result.output and "step 2: new tokens [1, 4]" in result.output
    # A step that samples no row (an empty logits_indices), then the chunk finishing that prompt.
    assert "step 3: new tokens [4], no row sampled (KV only)" in result.output
    assert "step 4: new tokens [2], max |Δlogits|" in result.output


def test_verify_onnx_exits_nonzero_beyond_tolerance(exported):
    # Float32 export and ORT differ by ~1e-7, never exactly 0: zero tolerance must fail.
    result = CliRunner().invoke(verify_onnx_cmd, [str(exported["llama"]), "--atol", "0",
                                                  "--rtol", "0"])
    assert result.exit_code != 0
    assert "MISMATCH" in result.output and "beyond tolerance" in result.output


def test_verify_catches_a_wrong_weight(engine_dirs, exported):
    engine = engine_dirs["qwen2"]
    cfg = read_engine_config(engine)
    model = load_network(engine, cfg)
    assert verify(model, exported["qwen2"] / "rank0.onnx", block_size=4).ok
    with torch.no_grad():
        model.layers[1].mlp.down.weight.mul_(1.01)
    report = verify(model, exported["qwen2"] / "rank0.onnx", block_size=4)
    assert not report.ok and report.steps[0].max_abs_diff > 1e-4


def test_export_json_records_the_engine(engine_dirs, exported):
    record = json.loads((exported["gpt2"] / "export.json").read_text())
    assert record["engine_dir"] == str(engine_dirs["gpt2"].resolve())
    assert record["kv_block_size"] == 4 and record["num_layers"] == 2


def test_check_graph_rejects_a_foreign_custom_node(exported, tmp_path):
    model = onnx.load(str(exported["llama"] / "rank0.onnx"))
    first = model.graph.node[0]
    model.graph.node.append(helper.make_node("Mystery", [first.output[0]], ["mystery_out"],
                                             domain="com.example"))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(BuildError, match="unexpected custom node com.example::Mystery"):
        check_graph(tmp_path / "bad.onnx", 2)


def test_verify_onnx_without_export_record_says_what_to_do(tmp_path):
    result = CliRunner().invoke(verify_onnx_cmd, [str(tmp_path)])
    assert result.exit_code != 0 and "trtforge export-onnx" in result.output


@pytest.mark.parametrize("variant", ["phi3-partial-rope", "gemma3-local-rope", "gemma2-softcap"])
def test_new_families_export_or_are_refused_by_name(variant, tmp_path):
    """Phi-3 (partial RoPE) and Gemma 3 (q/k norm, two RoPEs, sandwich norms, scaled embeddings, a final-logit
    cap) are plain torch around the op: exported and verified under ONNX Runtime. Gemma 2's attention
    soft-capping is not in the ONNX node (nor the TensorRT plugin): refused with its name."""
    from tests.helpers.checkpoints import make_variant
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig

    ckpt = make_variant(tmp_path / "ckpt", variant)
    engine, _ = build_engine(str(ckpt), tmp_path / "engine", BuildConfig(
        dtype="float32", max_batch_size=4, max_num_tokens=64, max_seq_len=64, kv_block_size=4,
        kv_cache_memory="1MiB"), progress=False)
    result = CliRunner().invoke(export_onnx_cmd, [str(engine), str(tmp_path / "onnx")])
    if variant.startswith("gemma2"):
        assert result.exit_code != 0 and "attn_logit_softcapping" in result.output
        return
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(verify_onnx_cmd, [str(tmp_path / "onnx")])
    assert result.exit_code == 0 and "-> OK" in result.output, result.output


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_moe_export_is_refused_by_name(variant, tmp_path):
    """A Mixture-of-Experts engine (torch backend) is not exported: its grouped routing is not in the graph."""
    from tests.builder.moe_checkpoints import make_moe_checkpoint
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig

    ckpt = make_moe_checkpoint(tmp_path / "ckpt", variant)
    engine, _ = build_engine(str(ckpt), tmp_path / "engine", BuildConfig(
        dtype="float32", max_batch_size=4, max_num_tokens=64, max_seq_len=64, kv_block_size=4,
        kv_cache_memory="1MiB"), progress=False)
    result = CliRunner().invoke(export_onnx_cmd, [str(engine), str(tmp_path / "onnx")])
    assert result.exit_code != 0 and "is a Mixture-of-Experts model" in result.output, result.output
    assert not (tmp_path / "onnx" / "rank0.onnx").exists()
