"""Options of `trtforge bench offline`, apart from the benchmark so that the CLI (and `trtforge
--help`) can build its options without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OfflineBenchConfig:
    """Options of `trtforge bench offline` (the CLI reads defaults and help from here)."""

    num_requests: int = 64
    """Requests in the workload, all submitted at once to trtforge."""
    baseline_requests: int | None = None
    """Run the HF baselines on only the first N requests (same distribution; HF one at a time on
    64 requests takes hours on 2 cores). None: all. Throughput is compared per output token."""
    prompt_len_min: int = 32
    """Shortest prompt (tokens); prompt lengths are uniform in [min, max]."""
    prompt_len_max: int = 512
    """Longest prompt (tokens)."""
    output_len_min: int = 32
    """Fewest tokens to generate; output lengths are uniform in [min, max], EOS ignored."""
    output_len_max: int = 256
    """Most tokens to generate."""
    static_batch_size: int = 8
    """Batch size of the HF static-batching baseline (b)."""
    threads: int = 2
    """torch.set_num_threads for every system (the same for all)."""
    kv_cache_memory: str = "384MiB"
    """trtforge's KV budget: small enough that it, not the request count, limits concurrency."""
    seed_prompt_lens: str = "10,50,100,200,500,1000,2000"
    """Prompt lengths of the TTFT-vs-decode experiment (comma-separated)."""
    seed_output_len: int = 100
    """Tokens generated per prompt in the TTFT-vs-decode experiment."""
    copy_probe_mib: int = 1024
    """Size of the copy-bandwidth probe in MiB; keep it far above the last-level cache."""
    skip_hf: bool = False
    """Skip the HF baselines (a) and (b) (quick runs of trtforge alone)."""
    seed: int = 0
    """Seed of the random workload."""

    def prompt_lens(self) -> list[int]:
        try:
            return [int(x) for x in self.seed_prompt_lens.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"seed_prompt_lens={self.seed_prompt_lens!r} is invalid: write "
                             "comma-separated integers, e.g. 10,50,100") from None
