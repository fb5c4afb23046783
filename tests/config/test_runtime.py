"""RuntimeConfig: how an engine runs (device, KV memory, phase, KV connector), and the scheduling
defaults a built engine records."""

from __future__ import annotations

import dataclasses

import pytest

from trtforge.config.runtime import SHARED_MEMORY_CONNECTOR, Phase, RuntimeConfig, parse_address
from trtforge.config.scheduler import SchedulerConfig


def test_defaults_are_documented_and_co_located():
    cfg = RuntimeConfig()
    assert cfg.phase is Phase.BOTH and cfg.kv_connector == SHARED_MEMORY_CONNECTOR
    assert cfg.device == "cpu" and cfg.kv_cache_memory is None and cfg.handoff_timeout_s > 0
    docs = RuntimeConfig.field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert all(len(d) > 15 for d in docs.values())


def test_phase_from_text_is_the_enum_and_reads_as_its_value():
    cfg = RuntimeConfig(phase="context")
    assert cfg.phase is Phase.CONTEXT and cfg.phase == "context" and f"{cfg.phase}" == "context"
    with pytest.raises(ValueError, match="phase='prefill' is invalid: must be one of both, context, generation"):
        RuntimeConfig(phase="prefill")


@pytest.mark.parametrize("kw, words", [
    (dict(kv_cache_memory="lots"), ["'lots'", "4GiB"]),
    (dict(handoff_timeout_s=0), ["handoff_timeout_s=0", "> 0"]),
    (dict(kv_connector="udp://x"), ["'udp://x'", "tcp://HOST:PORT"]),
    (dict(kv_connector=""), ["''", "tcp://HOST:PORT"]),
])
def test_bad_values_are_refused_with_a_clear_message(kw, words):
    with pytest.raises(ValueError) as err:
        RuntimeConfig(**kw)
    for w in words:
        assert w in str(err.value)


def test_from_text_converts_and_keeps_defaults_for_empty_values():
    cfg = RuntimeConfig.from_text({"device": "cuda:1", "kv_cache_memory": "", "cuda_graphs": "true",
                                   "phase": "generation", "handoff_timeout_s": "5"})
    assert (cfg.device, cfg.kv_cache_memory, cfg.cuda_graphs) == ("cuda:1", None, True)
    assert cfg.phase is Phase.GENERATION and cfg.handoff_timeout_s == 5.0
    with pytest.raises(ValueError, match="unknown runtime option"):
        RuntimeConfig.from_text({"max_batch_size": "4"})
    assert RuntimeConfig().with_overrides(kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20


def test_parse_address():
    assert parse_address("tcp://10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_address("host:0") == ("host", 0)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_address("tcp://host")


def test_a_built_engine_records_the_scheduler_defaults_within_its_limits():
    from trtforge.builder.build import default_scheduling
    from trtforge.builder.build_config import BuildConfig

    # A default build records what it always did (engine.json unchanged).
    assert default_scheduling(BuildConfig()) == {"max_num_tokens": 2048, "max_batch_size": 64,
                                                 "prefill_chunk_size": 512, "prefill_max_seqs": 64}
    # The budgets are the build's limits; the prefill limits SchedulerConfig's, capped by them.
    big = default_scheduling(BuildConfig(max_num_tokens=16384, max_batch_size=512))
    assert big == {"max_num_tokens": 16384, "max_batch_size": 512,
                   "prefill_chunk_size": SchedulerConfig.prefill_chunk_size,
                   "prefill_max_seqs": SchedulerConfig.prefill_max_seqs}
    small = default_scheduling(BuildConfig(max_num_tokens=128, max_batch_size=8))
    assert small == {"max_num_tokens": 128, "max_batch_size": 8, "prefill_chunk_size": 128,
                     "prefill_max_seqs": 8}
