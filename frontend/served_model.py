"""What the OpenAI endpoint serves, read from the Triton repository it fronts.

The repository's `ensemble/config.pbtxt` names the engine directory (parameter `engine_dir`); for a
disaggregated repository, whose `ensemble` is the router, the `context` / `generation` models beside
it name it; a router alone (`emit-repo --only router`) has none here: the operator names a copy of
the engine directory (`trtforge serve --served-engine-dir`). The engine directory has the tokenizer
(chat templates, /tokenize, the text of top_logprobs alternatives) and engine.json (max_seq_len:
the most prompt + output tokens of a request). The model id clients use is the engine directory's
name unless the operator chooses one.

A `--backend trtllm` repository (TensorRT-LLM's: its `ensemble` is a Triton ensemble) names the
engine directory as preprocessing's `tokenizer_dir`; which release's interface it has is read
from its ensemble's inputs (trtllm_interface.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtforge.frontend.errors import bad_request
from trtforge.frontend.schemas import ChatMessage
from trtforge.frontend.tool_parsers import (
    PARSER_MARKERS,
    TOOL_CALL_PARSERS,
    Parser,
    parse_forced,
    parser_for_template,
)
from trtforge.frontend.tool_prompt import conversation, template_source, template_takes_tools
from trtforge.frontend.tool_schemas import Tool
from trtforge.frontend.trtllm_interface import (
    TrtllmInterface,
    engine_dir_of_trtllm,
    is_trtllm_repo,
    load_interface,
)
from trtforge.model_repo.interface import ENSEMBLE
from trtforge.model_repo.params import ENGINE_DIR
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.phases import CONTEXT_MODEL, GENERATION_MODEL, ROLE, ROUTER_ROLE
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.errors import EngineLoadError


@dataclass
class ServedModel:
    """The one model behind the endpoint."""

    name: str
    """The model id of the API (GET /v1/models)."""
    engine_dir: Path
    tokenizer: Any
    """The engine's tokenizer, as the engine loads it (models/tokenizer.load_tokenizer)."""
    max_seq_len: int
    """Prompt + output tokens the engine allows per request."""
    triton_model: str = ENSEMBLE
    tool_call_parser: str | None = None
    """How tool calls are read from the output (tool_parsers.TOOL_CALL_PARSERS); None: the one the
    chat template's own format calls for (tool_parsers.parser_for_template)."""
    trtllm: TrtllmInterface | None = None
    """The repository is TensorRT-LLM's (`--backend trtllm`): its ensemble's interface at the
    recorded release it was written for (trtllm_interface.py); None: trtforge's own ensemble."""
    created: int = field(default_factory=lambda: int(time.time()))
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone (how top_logprobs name their alternatives)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (0 .. vocab_size - 1)."""
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """`text` as the engine encodes a prompt (no special tokens added), with the GIL released
        where the tokenizer can (see count_tokens)."""
        backend = getattr(self.tokenizer, "_backend", None)  # PlainTokenizer's tokenizers.Tokenizer
        if backend is not None and hasattr(backend, "encode_batch"):
            return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_token_texts(self, token_ids: list[int]) -> list[str]:
        """The text each prompt token adds to the text of those before it (special tokens kept;
        "" for a token that ends half a UTF-8 character, the next one carries it), so that they
        join into the decoded prompt: what echo's `logprobs.tokens` list. Decodes every
        prefix: O(P^2) characters, on the tokenizer pool."""
        texts, before = [], ""
        for i in range(len(token_ids)):
            text = self.tokenizer.decode(list(token_ids[:i + 1]), skip_special_tokens=False)
            if text.endswith("\ufffd") and i + 1 < len(token_ids):  # half a character: the next token completes it
                texts.append("")
                continue
            texts.append(text[len(before):] if text.startswith(before) else self.token_text(token_ids[i]))
            before = text
        return texts

    def keeps_special_tokens(self, forced: bool) -> bool:
        """The tool-call parser in effect reads a marker that this tokenizer holds as a special
        token (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`, a `<tool_call>` marked special):
        the output must keep special tokens (skip_special_tokens=false) for the parser to see it."""
        marker = None if forced else PARSER_MARKERS.get(self.tool_call_parser or "hermes")
        if marker is None:
            return False
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        special = {getattr(t, "content", str(t)) for t in decoder.values() if getattr(t, "special", False)}
        return marker in special or marker in set(getattr(self.tokenizer, "all_special_tokens", []) or [])

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens kept, as /detokenize returns them)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as the engine encodes a prompt (no special tokens added).

        The endpoints call it on a worker thread. For a plain `tokenizers` tokenizer
        (models/tokenizer.PlainTokenizer) it counts with `encode_batch`, the same ids: `encode`
        holds the GIL for the whole call (measured: a 2M-character prompt stopped every other
        thread for 6.6 s), `encode_batch` releases it (transformers' tokenizers use it already).
        """
        return len(self.encode(text))

    def __post_init__(self) -> None:
        if self.tool_call_parser is None:
            self.tool_call_parser = parser_for_template(template_source(self.tokenizer, True))
        elif self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")

    def tool_parser(self, forced: bool) -> Parser:
        """The parser of a choice's output: the grammar's format when the call was forced."""
        return parse_forced if forced else TOOL_CALL_PARSERS[self.tool_call_parser or "hermes"]

    def template_takes_tools(self) -> bool:
        """The chat template renders `tools` itself (else tool_prompt puts them in the system prompt)."""
        return template_takes_tools(template_source(self.tokenizer, True))

    def chat_prompt(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
        """The prompt text of a conversation, by the tokenizer's chat template; `tools`: those
        offered (tool_prompt.py: through the template, or in the system prompt when it takes none)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"The model {self.name!r} has no chat template (its tokenizer in "
                f"{self.engine_dir} defines none), so /v1/chat/completions cannot build a "
                "prompt; use /v1/completions, or add a chat_template to the checkpoint's "
                "tokenizer_config.json (or chat_template.jinja) and rebuild the engine.",
                param="messages")
        native = self.template_takes_tools()
        turns, offered = conversation(messages, tools, native, self.tool_call_parser or "hermes")
        try:
            return self.tokenizer.apply_chat_template(turns, tools=offered, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's raise_exception, missing keys, ...
            raise bad_request(f"The chat template refused these messages: "
                              f"{type(exc).__name__}: {exc}", param="messages") from None


def _engine_dir_param(config_path: Path) -> Path | None:
    """The `engine_dir` parameter of a model's config.pbtxt (relative paths are relative to the
    model directory, as the Triton model reads them); None when it has none."""
    value = parameters_of(read_config(config_path)).get(ENGINE_DIR, "")
    if not value:
        return None
    engine_dir = Path(value)
    return engine_dir if engine_dir.is_absolute() else config_path.parent / engine_dir


def engine_dir_of(repo: str | os.PathLike) -> Path:
    """The engine directory the repository's `ensemble` model serves: its own `engine_dir`, or,
    for the router of a disaggregated repository, that of its context (else generation) model in
    the same repository."""
    config_path = Path(repo) / ENSEMBLE / "config.pbtxt"
    if not config_path.is_file():
        raise FileNotFoundError(f"{repo} has no {ENSEMBLE}/config.pbtxt; write the repository "
                                "with `trtforge emit-repo ENGINE_DIR REPO_DIR`.")
    if is_trtllm_repo(repo):
        return engine_dir_of_trtllm(repo)
    own = _engine_dir_param(config_path)
    if own is not None:
        return own
    parameters = parameters_of(read_config(config_path))
    if parameters.get(ROLE) != ROUTER_ROLE:
        raise ValueError(f"{config_path} has no {ENGINE_DIR!r} parameter; re-emit the "
                         "repository with `trtforge emit-repo`.")
    phases = [parameters.get(CONTEXT_MODEL) or "context", parameters.get(GENERATION_MODEL) or "generation"]
    for name in phases:
        phase_config = Path(repo) / name / "config.pbtxt"
        if phase_config.is_file() and (found := _engine_dir_param(phase_config)) is not None:
            return found
    raise ValueError(
        f"{config_path} is the router of a disaggregated repository and neither of its phase models "
        f"({', '.join(phases)}) is in {repo} (written with `emit-repo --only router`?), so the OpenAI "
        "front end has no tokenizer or max_seq_len: pass --served-engine-dir ENGINE_DIR, a copy of "
        "the engine directory the phase models serve (its tokenizer and engine.json are read; the "
        "weight files must be there, unhashed).")


def load_served_model(repo: str | os.PathLike, name: str | None = None,
                      engine_dir: str | os.PathLike | None = None,
                      tool_call_parser: str | None = None) -> ServedModel:
    """Read the repository and its engine's tokenizer; FileNotFoundError/ValueError say why not.
    `engine_dir`: the engine directory to read instead of the one the repository names (a router
    on its own host)."""
    from trtforge.models.tokenizer import load_tokenizer  # heavy; only when serving

    if not (Path(repo) / ENSEMBLE / "config.pbtxt").is_file():
        engine_dir_of(repo)  # the message that says how to write one
    engine_dir = Path(engine_dir) if engine_dir is not None else engine_dir_of(repo)
    try:  # verified as the engine loads it before the tokenizer is read from it; the weights'
        # digests are the engine model's to check (it loads them, this process does not)
        engine = read_engine_config(engine_dir, verify_weights=False)
    except EngineLoadError as exc:
        raise ValueError(f"the repository's {ENGINE_DIR}: {exc}") from None
    return ServedModel(
        name=name or engine_dir.resolve().name,
        engine_dir=engine_dir,
        tokenizer=load_tokenizer(engine_dir),
        max_seq_len=engine.max_seq_len,
        tool_call_parser=tool_call_parser,
        trtllm=load_interface(repo) if is_trtllm_repo(repo) else None,
    )
