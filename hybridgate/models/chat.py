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

    Raises:
        ChatTemplateError: the template does not compile (at construction) or
            fails while rendering `messages`.
    """

    def __init__(self, tokenizer: Tokenizer, source: str | None = None):
        source = source if source is not None else tokenizer.chat_template
        if not source:
            raise ChatTemplateError("the model has no chat template (GGUF key 'tokenizer.chat_template')")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._tokenizer = tokenizer
        names = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special = re.compile("|".join(re.escape(n) for n in names)) if names else None
        # Private-use code points stand in for special-token strings inside content.
        self._mask = {n: f"\U000f0000{i}\U000f0001" for i, n in enumerate(names)}
        self._unmask = {v: k for k, v in self._mask.items()}
        self._unmask_re = re.compile("\U000f0000[0-9]+\U000f0001")
        self._specials_by_id = {i: t for t, i in tokenizer.special_tokens.items()}

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text, exactly as transformers' `apply_chat_template(tokenize=False)`."""
        return self._render(messages, add_generation_prompt)

    def _render(self, messages, add_generation_prompt: bool) -> str:
        tok = self._tokenizer
        token = lambda i: self._specials_by_id.get(i) or (tok.id_to_token(i) if 0 <= i < tok.vocab_size else None)  # noqa: E731
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=token(tok.bos_token_id),
                eos_token=token(tok.eos_token_id),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template failed: {exc}") from exc

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for `messages`; special-token strings in content are text.

        Each message is a mapping with `role` and `content` (str). Between the
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
        text = self._render(masked, add_generation_prompt)
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
