"""The OpenAI API's request bodies (pydantic) and their conversion to the router's values.

Fields follow the OpenAI API reference (Chat Completions, Completions, Embeddings) and the
extensions vLLM users rely on (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, skip_special_tokens). A field outside the API is
ignored, as vLLM does (and logged once per name); a field of the API that is
not supported here (functions, logit_bias, echo, suffix) is refused naming
it, never silently ignored. Chat takes `tools`, `tool_choice` and
`parallel_tool_calls`, and a history with an assistant's `tool_calls` and
`tool` messages (hybridgate.router.tools). Both endpoints take an output
constraint: `response_format` (json_object, json_schema), vLLM's
`structured_outputs` or its older `guided_*` fields (hybridgate.router.constraints).
"""

from __future__ import annotations

import base64
import difflib
import logging
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from hybridgate.router import constraints
from hybridgate.router.constraints import ConstraintLimits, Requested
from hybridgate.router.prompts import TokenIds
from hybridgate.router.tools import ToolRequest
from hybridgate.wire import MAX_SEED, InvalidFieldError, SamplingParams

log = logging.getLogger("hybridgate.gateway")

MAX_CHOICES = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: each chunk carries its choice's usage so far


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls: {id, type, function: {name, arguments}}
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning as answered (for a template that takes it)


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: EOS and the stop token ids masked until this many tokens were generated
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object
    guided_json: dict[str, Any] | str | None = None  # vLLM's older fields, one constraint each
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted without effect: one backend here


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[list[int]] | list[str]  # text, token ids (as vLLM), or several of either
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class EmbeddingRequest(_Body):
    """OpenAI's embeddings request: `input` a text, texts, token ids or lists of them."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


ENCODING_FORMATS = ("float", "base64")


def embedding_inputs(body: EmbeddingRequest) -> list:
    """The request's inputs as the router takes them: texts, and token ids as `TokenIds` (a flat list of ints
    is one input). Raises InvalidFieldError naming `encoding_format` when it is not float or base64."""
    if body.encoding_format not in ENCODING_FORMATS:
        raise InvalidFieldError("encoding_format", f"must be one of {', '.join(ENCODING_FORMATS)}, "
                                f"got {body.encoding_format!r}")
    given = body.input
    if isinstance(given, str):
        return [given]
    if given and all(isinstance(t, int) for t in given):
        return [TokenIds(given)]
    return [TokenIds(p) if isinstance(p, list) else p for p in given]


def embedding_body(vectors: list[np.ndarray], prompt_tokens: int, model: str, encoding_format: str) -> dict:
    """OpenAI's embeddings answer: each vector as a list of floats, or as base64 of its float32
    little-endian bytes (what OpenAI's clients decode with `np.frombuffer(..., "float32")`)."""
    def encoded(v: np.ndarray):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding_format == "base64" else v.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class _Unknown:
    """Names of fields outside the API, each logged once per process."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def note(self, body: BaseModel, prefix: str = "") -> None:
        """Log each field of `body` outside its model once, with the nearest field's name (a typo such as
        `max_token` leaves the request running to its default length, and a client sees no error)."""
        for name in body.model_extra or {}:
            if prefix + name not in self.seen:
                self.seen.add(prefix + name)
                near = difflib.get_close_matches(name, type(body).model_fields, n=1)
                log.warning("ignoring the request field %r: it is not part of the OpenAI API this gateway serves%s "
                            "(logged once)", prefix + name, f"; did you mean {near[0]!r}?" if near else "")


unknown_fields = _Unknown()


def refuse_unsupported(body: _Sampling) -> None:
    """Raise InvalidFieldError naming the first field of the API that is set but not supported."""
    if body.logit_bias:
        raise InvalidFieldError("logit_bias", "is not supported by this server")
    if isinstance(body, ChatCompletionRequest):
        if body.functions:
            raise InvalidFieldError("functions", "the deprecated function calling is not supported: use tools")
    else:
        if body.echo:
            raise InvalidFieldError("echo", "is not supported by this server")
        if body.suffix:
            raise InvalidFieldError("suffix", "is not supported by this server")


def completion_prompts(body: CompletionRequest) -> list:
    """The prompts of a completion request: one text, one list of token ids, or a list of either (each a
    choice's prompt; token ids as `TokenIds`). Raises InvalidFieldError naming `prompt`."""
    given = body.prompt
    if isinstance(given, str):
        return [given]
    if given and all(isinstance(t, int) for t in given):
        return [TokenIds(given)]
    prompts = [TokenIds(p) if isinstance(p, list) else p for p in given]
    if not 1 <= len(prompts) <= MAX_CHOICES:
        raise InvalidFieldError("prompt", f"a list of 1 to {MAX_CHOICES} prompts, got {len(prompts)}")
    return prompts


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the router takes them: string content; text parts joined with newlines, as vLLM."""
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise InvalidFieldError(f"messages[{i}].content[{j}].type",
                                            f"only text parts are supported, got {part.type!r}")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        out.append(_with_tool_fields(i, m, {"role": m.role, "content": content}))
    return out


def _with_tool_fields(i: int, m: ChatMessage, out: dict) -> dict:
    """`out` with the message's calls (an assistant's) or the call it answers (a tool's), checked."""
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidFieldError(f"messages[{i}].tool_calls", "only an assistant message has tool calls")
        for j, call in enumerate(m.tool_calls):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidFieldError(f"messages[{i}].tool_calls[{j}].function", "must be an object with a name")
        out["tool_calls"] = m.tool_calls
    if m.role == "tool":
        if m.tool_call_id is None:
            raise InvalidFieldError(f"messages[{i}].tool_call_id", "a tool message needs the id of its call")
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content and m.role == "assistant":
        out["reasoning_content"] = m.reasoning_content
    if m.name is not None:
        out["name"] = m.name
    return out


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The chat's tools, tool_choice and parallel_tool_calls (None: no tools). Raises InvalidFieldError."""
    return ToolRequest.from_openai(body.tools, body.tool_choice, body.parallel_tool_calls)


def output_constraint(body: _Sampling, limits: ConstraintLimits) -> Requested | None:
    """The request's output constraint and the field that set it (None: free text). Raises InvalidFieldError."""
    return constraints.from_openai({name: getattr(body, name) for name in CONSTRAINT_FIELDS}, limits)


def sampling_params(body: _Sampling, logprobs: int | None, requested: Requested | None = None) -> SamplingParams:
    """The router's parameters for one choice (choice i's seed is the caller's: seed + i).

    Raises InvalidFieldError naming the API field (n, seed; the rest are checked by the router).
    """
    if not 1 <= body.n <= MAX_CHOICES:
        raise InvalidFieldError("n", f"must be in [1, {MAX_CHOICES}], got {body.n}")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED - (body.n - 1):
        raise InvalidFieldError("seed", f"must be in [0, 2**64 - n], got {body.seed}")
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens  # it wins over the deprecated max_tokens
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    given = {k: v for k, v in dict(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty).items() if v is not None}
    return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
                          min_tokens=body.min_tokens,
                          skip_special_tokens=body.skip_special_tokens,
                          stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
                          constraint=requested.constraint if requested is not None else None, **given)


def chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    """How many alternatives each token's logprobs carry (None: no logprobs)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidFieldError("top_logprobs", "needs logprobs: true")
    return (body.top_logprobs or 0) if body.logprobs else None


def param_of(field: str, body: _Sampling) -> str:
    """The API's name of a router field: the chat API calls the alternatives top_logprobs, the prompt its
    messages, and max_completion_tokens when that was the field given; the request's label is the API's `user`; its
    constraint the field that set it (response_format.json_schema.schema, structured_outputs.regex, ...)."""
    if field == "label":
        return "user"
    if field == "constraint":
        try:
            requested = output_constraint(body, ConstraintLimits(1 << 62, 1 << 62))
        except InvalidFieldError as exc:
            return exc.field
        return requested.field if requested is not None else field
    if isinstance(body, ChatCompletionRequest):
        if field == "prompt":  # the prompt a chat's messages made (its length against the max model length)
            return "messages"
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
    return field
