"""SpeculativeConfig: vLLM's JSON shape, read through RuntimeConfig; unknown methods and fields are
refused with what is known; bad values name themselves."""

import subprocess
import sys

import pytest

from trtforge.config.runtime import RuntimeConfig
from trtforge.config.speculative import SpeculativeConfig


def test_vllm_json_is_read_through_runtime_config():
    text = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    runtime = RuntimeConfig(speculative_config=text)
    spec = runtime.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (5, 3, 1)
    assert SpeculativeConfig.parse(spec.to_json()) == spec, "the JSON round-trips"
    assert RuntimeConfig.from_text({"speculative_config": text}).speculative_config == spec, "Triton parameter"
    assert RuntimeConfig(speculative_config="").speculative_config is None
    assert RuntimeConfig().speculative_config is None


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle"}', "not supported: known methods are ngram"),
    ('{"method": "ngram", "num_lookahead": 2}', r"unknown field\(s\) \['num_lookahead'\]; known: method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0 is invalid"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens='4' is invalid: expected an integer"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min=3 and prompt_lookup_max=2"),
    ('{"disable_by_batch_size": 0}', "disable_by_batch_size=0 is invalid"),
    ('ngram', "is not JSON"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_configs_are_refused_clearly(text, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(speculative_config=text)


def test_every_field_is_documented_and_the_module_is_torch_free():
    assert set(SpeculativeConfig.field_docs()) == set(SpeculativeConfig.KNOWN)
    code = ("import sys, trtforge.config.speculative, trtforge.config.runtime; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
