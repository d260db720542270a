"""Chat templates: the model's Jinja template, rendered as transformers renders it.

The environment (sandbox, options, filters, globals) follows transformers'
`utils/chat_template_utils.py`, so templates written for transformers render
the same here. Special-token strings inside message content are kept as text:
content is masked before rendering and encoded with special tokens off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridgate.models.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")

# The special-token variables transformers hands a template (`PreTrainedTokenizerBase.special_tokens_map`),
# each with the GGUF key of its id (llama.cpp's gguf-py, `Keys.Tokenizer`; "seperator" is its spelling).
TEMPLATE_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",
    "cls_token": "tokenizer.ggml.cls_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}
NO_TEMPLATE = ("the model has no chat template (no GGUF key 'tokenizer.chat_template': a base model, which serves "
               "completions); give one with --chat-template FILE to serve chats")


def template_token_ids(metadata: Mapping[str, Any]) -> dict[str, int]:
    """The ids of TEMPLATE_TOKEN_KEYS' variables that a GGUF's metadata names (absent ones left out)."""
    return {var: int(metadata[key]) for var, key in TEMPLATE_TOKEN_KEYS.items() if key in metadata}


class ChatTemplateError(ValueError):
    """The chat template failed for these `messages`."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant spans)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template bound to a tokenizer.

    `source`: the template text (default: the model's own, `tokenizer.chat_template`).
    `token_ids`: the special-token variables the template is given, by id (`template_token_ids`
    of the GGUF's metadata); default: `bos_token` and `eos_token` of the tokenizer. A model with
    no template (a base model) builds one whose `present` is False: it serves no chat.

    Raises:
        ChatTemplateError: the template does not compile (at construction); it fails while
            rendering `messages`, or there is none (naming --chat-template) (at render/encode).
    """

    def __init__(self, tokenizer: Tokenizer, source: str | None = None, token_ids: Mapping[str, int] | None = None):
        source = source if source is not None else tokenizer.chat_template
        self._template = None
        self._source = source or None
        if source:
            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._tokenizer = tokenizer
        ids = dict(token_ids) if token_ids is not None else \
            {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
        self._token_ids = {var: i for var, i in ids.items() if 0 <= i < tokenizer.vocab_size}
        names = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special = re.compile("|".join(re.escape(n) for n in names)) if names else None
        # Private-use code points stand in for special-token strings inside content.
        self._mask = {n: f"\U000f0000{i}\U000f0001" for i, n in enumerate(names)}
        self._unmask = {v: k for k, v in self._mask.items()}
        self._unmask_re = re.compile("\U000f0000[0-9]+\U000f0001")
        self._specials_by_id = {i: t for t, i in tokenizer.special_tokens.items()}

    @property
    def present(self) -> bool:
        """Whether there is a template to render (False for a base model given none)."""
        return self._template is not None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text, exactly as transformers' `apply_chat_template(tokenize=False)`; `tools`: the
        template's `tools` variable (OpenAI's `{"type": "function", "function": {...}}` objects), or None."""
        return self._render(messages, add_generation_prompt, tools)

    @property
    def takes_tools(self) -> bool:
        """Whether the template's source mentions `tools` (it renders them itself)."""
        return self._source is not None and "tools" in self._source

    def _render(self, messages, add_generation_prompt: bool, tools=None) -> str:
        if self._template is None:
            raise ChatTemplateError(NO_TEMPLATE)  # every caller names the field (messages)
        tok = self._tokenizer
        tokens = {var: self._specials_by_id.get(i) or tok.id_to_token(i) for var, i in self._token_ids.items()}
        try:
            return self._template.render(
                {"bos_token": None, "eos_token": None, **tokens},
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template failed: {exc}") from exc

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids for `messages` (and the template's `tools`); special-token strings in content are text.

        Each message is a mapping with `role` and `content` (str), and may carry `tool_calls`,
        `tool_call_id` and `name` (an assistant's calls, a tool's result) for the template. Between the
        special tokens the template emits, text is encoded whole, so the ids
        equal transformers' `apply_chat_template(tokenize=True)` whenever no
        content holds a special-token string.

        Raises:
            ChatTemplateError: empty `messages`, a message without string
                `content`, or a template failure (all naming `messages`).
        """
        if not messages:
            raise ChatTemplateError("messages: at least one message is required")
        masked = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, str):
                raise ChatTemplateError(f"messages[{i}].content must be a string")
            if self._special is not None:
                content = self._special.sub(lambda x: self._mask[x.group(0)], content)
            masked.append({**m, "content": content})
        text = self._render(masked, add_generation_prompt, tools)
        return self._encode_rendered(text)

    def _encode_rendered(self, text: str) -> list[int]:
        tok = self._tokenizer
        ids: list[int] = []
        pos = 0
        pieces = list(self._special.finditer(text)) if self._special is not None else []
        for match in pieces:
            ids += self._encode_text(text[pos : match.start()])
            ids.append(tok.special_tokens[match.group(0)])
            pos = match.end()
        ids += self._encode_text(text[pos:])
        return ids

    def _encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        text = self._unmask_re.sub(lambda x: self._unmask.get(x.group(0), x.group(0)), text)
        return self._tokenizer.encode(text, special_tokens=False)
