"""Networks are built on meta without initialisation, and a tensor the file lacks is an error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from trtforge.models.skip_init import build_on_meta, still_on_meta


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("table", torch.zeros(3), persistent=False)


def test_everything_on_meta_until_assigned():
    net = build_on_meta(_Net)
    assert sorted(still_on_meta(net)) == ["embed.weight", "norm.bias", "norm.weight", "proj.bias",
                                          "proj.weight", "table"]
    state = {k: torch.full(v.shape, 2.0) for k, v in net.state_dict().items()}
    net.load_state_dict(state, assign=True)
    assert still_on_meta(net) == ["table"]  # not persistent: a loader must compute it
    assert torch.equal(net.proj.weight, torch.full((4, 4), 2.0))


def test_init_outside_the_context_still_runs():
    build_on_meta(_Net)
    layer = nn.Linear(4, 4)
    assert layer.weight.abs().sum() > 0


def test_no_dynamo_import():
    code = ("import sys; from torch import nn; from trtforge.models.skip_init import build_on_meta; "
            "build_on_meta(lambda: nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_network_names_a_tensor_the_file_lacks(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.helpers.checkpoints import make_checkpoint
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig
    from trtforge.models.engine_dir import read_engine_config
    from trtforge.models.errors import EngineLoadError
    from trtforge.models.loader import load_network

    out, cfg = build_engine(str(make_checkpoint(tmp_path / "ckpt", "llama")), tmp_path / "eng",
                            BuildConfig(dtype="float32", kv_cache_memory="1MiB", max_seq_len=64), progress=False)
    weights = out / "rank0.safetensors"
    state = load_file(str(weights))
    assert not still_on_meta(load_network(out, cfg))
    del state["rope_inv_freq"]
    save_file(state, str(weights))
    with pytest.raises(EngineLoadError, match="rope_inv_freq"):
        load_network(out, read_engine_config(out, verify_checksums=False))
