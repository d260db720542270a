"""Responses and stream chunks of the OpenAI API, built from the router's deltas.

Shapes as the OpenAI API reference shows them: `chat.completion` and
`chat.completion.chunk` (the first delta of each choice carries
`role: "assistant"`, no later one does), `text_completion` for both forms of
completions; each choice's last chunk carries its `finish_reason`, once; with
`stream_options.include_usage` every chunk has `usage: null` and one last chunk
has the usage and `choices: []`; with vLLM's extension
`stream_options.continuous_usage_stats` as well, every chunk carries its
choice's usage so far instead of null (and a delta of ids without text gets a
chunk too), so a client can time the tokens themselves. Server-sent events are `data: {json}\\n\\n`,
the last `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import msgspec

from hybridgate.router import Delta, GenerationStream, Router
from hybridgate.router.deltas import Usage
from hybridgate.wire import FinishReason, TokenLogprobs

_FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length",
           FinishReason.ABORT: "abort"}
_ENCODE = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return b"data: " + _ENCODE(obj) + b"\n\n"


@dataclass
class ChoiceState:
    """One choice of a request: its stream and what it has produced."""

    index: int
    stream: GenerationStream  # or the response cache's CachedStream (the same interface)
    prompt_index: int = 0
    logprobs_wanted: bool = False
    label: str = ""
    entered: bool = False
    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    last_at: float | None = None  # when its last delta came (the ITL)
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # a format with channels: the reasoning, out of `texts`
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offset: int = 0  # characters of text already streamed (completions' text_offset)
    tokens: int = 0  # ids streamed so far
    finish: FinishReason | None = None
    usage: Usage | None = None
    calls: dict[int, dict] = field(default_factory=dict)  # index -> the call's OpenAI object, as streamed

    def add(self, delta: Delta) -> None:
        if delta.tool_calls:
            self._add_calls(delta.tool_calls)
        self.texts.append(delta.text)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        self.tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish, self.usage = delta.finish_reason, delta.usage

    def _add_calls(self, deltas) -> None:
        for d in deltas:
            call = self.calls.get(d.index)
            if call is None:
                self.calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name,
                                                                                    "arguments": d.arguments}}
            else:
                call["function"]["arguments"] += d.arguments

    @property
    def finish_reason(self) -> str:
        """The API's finish reason: `tool_calls` when the model stopped after calling tools."""
        if self.calls and self.finish in (FinishReason.STOP, FinishReason.EOS):
            return "tool_calls"
        return _FINISH.get(self.finish, "stop")

    def message(self) -> dict:
        """The chat message: content null when empty beside calls; `tool_calls` when there are any;
        `reasoning_content` (vLLM's field) when the model wrote reasoning in its channel."""
        text = "".join(self.texts)
        out = {"role": "assistant", "content": text}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            out["content"] = text or None
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return out


def tool_call_deltas(deltas) -> list[dict]:
    """A chunk's `delta.tool_calls`: a call's first carries index, id, type and name; later ones its index and
    the next fragment of its arguments."""
    out = []
    for d in deltas:
        if d.name is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


class Formatter:
    """Builds the bodies for one served model name; token strings come from the router's tokenizer."""

    def __init__(self, router: Router, model_name: str):
        self.router, self.model_name = router, model_name
        self.created = int(time.time())
        self.fingerprint = "fp_" + router.fingerprint[:12]

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.router.tokenizer.token_bytes[token_id]
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, ids: list[int], lps: list[TokenLogprobs]) -> dict:
        content = []
        for tid, lp in zip(ids, lps):
            text, raw = self._token(tid)
            top = [dict(zip(("token", "bytes"), self._token(i)), logprob=v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def text_logprobs(self, ids: list[int], lps: list[TokenLogprobs], offset: int) -> dict:
        tokens, offsets = [], []
        for tid in ids:
            text = self._token(tid)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "text_offset": offsets,
                "top_logprobs": [{self._token(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs)} for lp in lps]}

    def usage(self, states: list[ChoiceState]) -> dict:
        """Prompt tokens once per prompt (as OpenAI counts them with n > 1), completion tokens of every choice."""
        firsts = {s.prompt_index: s for s in reversed(states) if s.usage is not None}
        prompt = sum(s.usage.prompt_tokens for s in firsts.values())
        completion = sum(s.usage.completion_tokens for s in states if s.usage is not None)
        cached = sum(s.usage.cached_tokens for s in firsts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _head(self, kind: str, rid: str, chunk: bool, created: int | None = None) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()) if created is None else created,
                "model": self.model_name, "system_fingerprint": self.fingerprint}

    def whole(self, kind: str, states: list[ChoiceState]) -> dict:
        """The non-streamed response of finished choices."""
        choices = []
        for s in states:
            ids = list(s.stream.ids)
            text = "".join(s.texts)
            want = s.logprobs_wanted
            if kind == "chat":
                choices.append({"index": s.index, "message": s.message(),
                                "logprobs": self.chat_logprobs(ids, s.logprobs) if want else None,
                                "finish_reason": s.finish_reason})
            else:
                choices.append({"index": s.index, "text": text,
                                "logprobs": self.text_logprobs(ids, s.logprobs, 0) if want else None,
                                "finish_reason": _FINISH.get(s.finish, "stop")})
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return {**self._head(kind, prefix + uuid.uuid4().hex, False), "choices": choices, "usage": self.usage(states)}

    def chunks(self, kind: str, states: list[ChoiceState], include_usage: bool,
               continuous_usage: bool = False) -> Chunks:
        return Chunks(self, kind, states, include_usage, continuous_usage)


class Chunks:
    """The server-sent events of one streamed request."""

    def __init__(self, fmt: Formatter, kind: str, states: list[ChoiceState], include_usage: bool,
                 continuous_usage: bool = False):
        self.fmt, self.kind, self.states, self.include_usage = fmt, kind, states, include_usage
        self.continuous = include_usage and continuous_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self._framing: dict[int, tuple[int, bytes, bytes]] = {}  # choice index -> (second, before, after)

    def _text_chunk(self, index: int, text: str) -> bytes:
        """The chunk of a choice's text and nothing else (most chunks): the event as `_chunk` writes it,
        from bytes made once per choice and second (`created`) around the encoded text; the same bytes,
        at a fraction of the cost of encoding the whole object per token."""
        now = int(time.time())
        framing = self._framing.get(index)
        if framing is None or framing[0] != now:
            mark = "\x00" + uuid.uuid4().hex  # occurs nowhere else in the object
            field = {"content": mark} if self.kind == "chat" else mark
            choice = {"index": index, "delta": field} if self.kind == "chat" else {"index": index, "text": field}
            choice.update(logprobs=None, finish_reason=None)
            obj = {**self.fmt._head(self.kind, self.id, True, now), "choices": [choice]}
            if self.include_usage:
                obj["usage"] = None
            before, _, after = sse(obj).partition(_ENCODE(mark))
            framing = self._framing[index] = (now, before, after)
        return framing[1] + _ENCODE(text) + framing[2]

    def _chunk(self, choices: list[dict], state: ChoiceState | None = None) -> bytes:
        obj = {**self.fmt._head(self.kind, self.id, True), "choices": choices}
        if self.include_usage:
            obj["usage"] = None
            if self.continuous and state is not None:
                prompt = len(state.stream.prompt_ids)
                obj["usage"] = {"prompt_tokens": prompt, "completion_tokens": state.tokens,
                                "total_tokens": prompt + state.tokens}
        return sse(obj)

    def opening(self) -> list[bytes]:
        """Chat: each choice's first delta, the assistant role (content empty); completions: nothing."""
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for s in self.states]

    def delta(self, state: ChoiceState, delta: Delta) -> list[bytes]:
        finish = state.finish_reason if delta.finish_reason is not None else None
        want = state.logprobs_wanted
        plain = not delta.tool_calls and not delta.reasoning
        if delta.text and finish is None and plain and not want and not self.continuous:
            return [self._text_chunk(state.index, delta.text)]
        if not delta.text and finish is None and plain and \
                not ((want or self.continuous) and delta.token_ids):
            return []
        ids = delta.token_ids[: len(delta.logprobs)]
        if self.kind == "chat":
            body = {"content": delta.text} if delta.text else {}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                body["tool_calls"] = tool_call_deltas(delta.tool_calls)
            choice = {"index": state.index, "delta": body,
                      "logprobs": self.fmt.chat_logprobs(ids, list(delta.logprobs)) if want else None,
                      "finish_reason": finish}
        else:
            choice = {"index": state.index, "text": delta.text,
                      "logprobs": self.fmt.text_logprobs(ids, list(delta.logprobs), state.offset) if want else None,
                      "finish_reason": finish}
            state.offset += sum(len(self.fmt._token(t)[0]) for t in ids)
        return [self._chunk([choice], state)]

    def closing(self) -> list[bytes]:
        out = []
        if self.include_usage:
            out.append(sse({**self.fmt._head(self.kind, self.id, True), "choices": [],
                            "usage": self.fmt.usage(self.states)}))
        out.append(DONE)
        return out

    def error(self, envelope: dict) -> bytes:
        """An error after the stream began: one event with the error envelope, then [DONE]."""
        return sse(envelope) + DONE
