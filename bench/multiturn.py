"""A multi-turn chat workload against an OpenAI endpoint: each conversation resends its whole
history every turn, so a router that sends a conversation back to the worker holding its blocks
saves the prefill of everything but the new turn.

    sessions (concurrent threads) × turns (sequential per session)
    turn k: [system context of the session] + k user messages + the k-1 answers so far
            → one streamed chat completion (`stream_options.include_usage`: the server's prompt,
              cached and output token counts)

Each session's text starts with a random tag, so two runs (two routers) never share a prefix.
What is measured per turn is a bench.serve_metrics.RequestRecord (TTFT, per-chunk times), plus the
prompt tokens the server reports it served from its prefix cache.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from trtforge.bench.serve_metrics import RequestRecord, compute_metrics

_WORDS = ("river stone lamp garden window paper engine signal harbor market winter copper forest "
          "letter bridge candle orbit meadow silver thunder castle valley mirror anchor").split()


@dataclass
class MultiTurnConfig:
    """The workload's shape (scripts/bench_dynamo_multiturn.py's flags)."""

    sessions: int = 8
    """Conversations running at once (one client thread each)."""
    turns: int = 4
    """Turns per conversation; turn k resends the k-1 before it."""
    context_words: int = 150
    """Words of the session's opening context (a document the conversation is about)."""
    user_words: int = 12
    """Words of each user message."""
    max_tokens: int = 24
    """Tokens each answer asks for (ignore_eos: exactly this many)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "context_words", "user_words", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass
class TurnRecord(RequestRecord):
    session: int = 0
    turn: int = 0
    cached_tokens: int = 0
    """Prompt tokens the server served from its prefix cache (usage.prompt_tokens_details)."""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def conversation_openings(cfg: MultiTurnConfig, run_tag: str) -> list[tuple[str, list[str]]]:
    """Per session: its context message and its user messages (deterministic in seed and tag)."""
    out = []
    for s in range(cfg.sessions):
        rng = random.Random(f"{cfg.seed}-{run_tag}-{s}")
        context = f"[{run_tag}-{s}] " + _words(rng, cfg.context_words)
        out.append((context, [_words(rng, cfg.user_words) + "?" for _ in range(cfg.turns)]))
    return out


def _turn(client: Any, model: str, messages: list[dict], cfg: MultiTurnConfig, rec: TurnRecord) -> str:
    rec.start = time.perf_counter()
    text = []
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=cfg.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                rec.chunk_times.append(now)
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                rec.prompt_len, rec.output_len = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                rec.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        rec.end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - a failed turn is counted as failed, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"
    return "".join(text)


def run(base_url: str, model: str, cfg: MultiTurnConfig, run_tag: str) -> dict[str, Any]:
    """Run the workload once against `base_url`; the summary (bench.serve_metrics) and turn records."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    records: list[TurnRecord] = []
    lock = threading.Lock()

    def session(s: int, context: str, users: list[str]) -> None:
        messages = [{"role": "system", "content": context}]
        for k, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            rec = TurnRecord(start=0.0, session=s, turn=k)
            answer = _turn(client, model, messages, cfg, rec)
            with lock:
                records.append(rec)
            if rec.error:
                return
            messages.append({"role": "assistant", "content": answer})

    threads = [threading.Thread(target=session, args=(s, c, u), daemon=True)
               for s, (c, u) in enumerate(conversation_openings(cfg, run_tag))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    later = [r for r in records if r.turn > 0 and r.ok]
    metrics = compute_metrics(records, duration)
    return {"metrics": metrics.to_dict(), "duration_s": duration,
            "later_turns_cached_fraction": (sum(r.cached_tokens for r in later) / sum(r.prompt_len for r in later)
                                            if later else float("nan")),
            "turns": [asdict(r) for r in records]}
