"""Protobuf stops here: requests to plain Python values (validated), deltas to responses."""

from __future__ import annotations

import functools
import json

import msgspec

from hybridgate.router import Delta, constraints
from hybridgate.router.constraints import ConstraintLimits
from hybridgate.router.prompts import TokenIds
from hybridgate.router.router import Prompt
from hybridgate.router.toolparse import ToolCall
from hybridgate.router.tools import ToolRequest
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import Constraint, InvalidFieldError, SamplingParams


# The request's fields that are SamplingParams fields: one loop copies them (see _sampling_params).
_PARAM_FIELDS = tuple(f for f in pb.GenerateRequest.DESCRIPTOR.fields if f.name in SamplingParams.__struct_fields__)


def _sampling_params(req: pb.GenerateRequest) -> SamplingParams:
    """The request's sampling fields as SamplingParams: an `optional` field left unset is left out, so it
    takes SamplingParams' default, written once there (the proto's doc comments name the same values)."""
    given = {}
    for field in _PARAM_FIELDS:
        if field.is_repeated:
            given[field.name] = tuple(getattr(req, field.name))
        elif not field.has_presence or req.HasField(field.name):
            given[field.name] = getattr(req, field.name)
    return SamplingParams(**given)


# The `constraint` oneof's fields: how each becomes a Constraint (hybridgate.router.constraints).
_CONSTRAINTS = {"json_schema": lambda v, limits: constraints.json_schema(v, "json_schema", limits),
                "regex": lambda v, limits: constraints.regex(v, "regex", limits),
                "grammar": lambda v, limits: constraints.grammar(v, "grammar", limits),
                "choice": lambda v, limits: constraints.choice(list(v.choices), "choice.choices", limits)}


def _constraint(req: pb.GenerateRequest, limits: ConstraintLimits) -> Constraint | None:
    which = req.WhichOneof("constraint")
    return None if which is None else _CONSTRAINTS[which](getattr(req, which), limits)


def _message(m: pb.ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def tools_to_native(req: pb.GenerateRequest) -> ToolRequest | None:
    """The request's tools as the router takes them (None: no tools), checked as the OpenAI door checks them.

    Raises InvalidFieldError naming the field (`tools[0].function.parameters` for a Tool's parameters).
    """
    tools = []
    for i, t in enumerate(req.tools):
        try:
            parameters = json.loads(t.parameters) if t.parameters else None
        except ValueError as exc:
            raise InvalidFieldError(f"tools[{i}].parameters", f"is not valid JSON ({exc})") from None
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": parameters}})
    which = req.WhichOneof("tool_choice")
    choice = None if which is None else req.tool_mode if which == "tool_mode" else \
        {"type": "function", "function": {"name": req.tool_function}}
    given = {}  # unset: ToolRequest's default
    if req.HasField("parallel_tool_calls"):
        given["parallel_tool_calls"] = req.parallel_tool_calls
    return ToolRequest.from_openai(tools, choice, **given)


def request_to_native(req: pb.GenerateRequest, limits: ConstraintLimits = ConstraintLimits()) \
        -> tuple[Prompt, SamplingParams]:
    """(prompt or messages, sampling params) of a request, as plain Python values; its constraint built
    within `limits` (the router's)

    Only what protobuf alone knows is checked here (which input is set); the
    limits of every field are checked once, by `Router.generate`, for the
    gateway and for services that embed the router alike.

    Raises:
        InvalidFieldError: neither prompt nor chat is set.
    """
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidFieldError("prompt", "must not be empty (set prompt or chat)")
    if which == "prompt":
        prompt: Prompt = req.prompt
    else:
        prompt = [_message(m) for m in req.chat.messages]
    params = _sampling_params(req)
    constraint = _constraint(req, limits)
    return prompt, params if constraint is None else msgspec.structs.replace(params, constraint=constraint)


def embed_inputs_to_native(req: pb.EmbedRequest) -> list[str | TokenIds]:
    """The request's inputs as the router takes them (texts, `TokenIds`). Raises InvalidFieldError naming
    an input that sets neither text nor tokens."""
    inputs = []
    for i, item in enumerate(req.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidFieldError(f"inputs[{i}]", "set text or tokens")
        inputs.append(item.text if kind == "text" else TokenIds(item.tokens.token_ids))
    return inputs


# Protobuf's wire format (https://protobuf.dev/programming-guides/encoding/) of the GenerateResponse fields a
# plain delta sets: (field number << 3) | wire type, 0 a varint, 2 length-delimited (packed ids among them).
_REQUEST_ID, _TOKEN_INDEX, _TEXT, _TOKEN_IDS = b"\x0a", b"\x10", b"\x1a", b"\x22"
_TWO_BYTES = 1 << 14  # the values of one- and two-byte varints: a message's token index and lengths


def _varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf varint: 7 bits a byte, least significant first, the high bit on all but
    the last."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def _varints() -> tuple[bytes, ...]:
    """`_varint(v)` of every v below _TWO_BYTES (made on first use: 0.6 MB)."""
    return tuple(_varint(v) for v in range(_TWO_BYTES))


@functools.cache
def _index_fields() -> tuple[bytes, ...]:
    """The token_index field of every index below _TWO_BYTES, b"" for 0 (the default, left out; made on first
    use: 0.6 MB)."""
    varints = _varints()
    return (b"",) + tuple(_TOKEN_INDEX + varints[i] for i in range(1, _TWO_BYTES))


class _OneIdFields(dict):
    """The token_ids field of a message of one id (packed: its length, then its varint), by id, each made
    on first use: at most one entry per id of the vocabulary."""

    def __missing__(self, token_id: int) -> bytes:
        packed = _varint(token_id)
        field = self[token_id] = _TOKEN_IDS + _varint(len(packed)) + packed
        return field


@functools.cache
def _one_id_fields() -> _OneIdFields:
    return _OneIdFields()


class ResponseEncoder:
    """One call's `GenerateResponse`s as bytes, for a Generate registered without a response serializer.

    A delta of `request_id`'s with text and ids only (no finish, logprobs or reasoning: almost every
    message) is encoded here, field by field, to the bytes `delta_to_proto(delta).SerializeToString()`
    gives (fields in number order, those at their default left out, ids packed); that skips building a
    message object per streamed token, which costs three times as much. The fields that repeat (the
    request id, a token index, one id) are looked up, not encoded again. Any other delta, and one whose
    token index, text or ids pass 16 KiB, goes through `delta_to_proto`.
    """

    def __init__(self, request_id: str):
        rid = request_id.encode()
        self.request_id, self._varints = request_id, _varints()
        self._index_fields, self._one_id_fields = _index_fields(), _one_id_fields()
        self._head = _REQUEST_ID + self._varints[len(rid)] + rid if 0 < len(rid) < _TWO_BYTES else None

    def encode(self, delta: Delta, calls: list[ToolCall] = ()) -> bytes:
        """The serialized response of `delta` (`calls`: as `delta_to_proto` takes them)."""
        ids, index, text = delta.token_ids, delta.token_index, delta.text.encode()
        if delta.finish_reason is None and not delta.logprobs and not delta.reasoning and self._head is not None \
                and delta.request_id == self.request_id and index < _TWO_BYTES and len(text) < _TWO_BYTES:
            ids_field = self._one_id_fields[ids[0]] if len(ids) == 1 else self._ids_field(ids)
            if ids_field is not None:
                return b"".join((self._head, self._index_fields[index],
                                 _TEXT + self._varints[len(text)] + text if text else b"", ids_field))
        return delta_to_proto(delta, calls).SerializeToString()

    def _ids_field(self, ids: list[int]) -> bytes | None:
        """The token_ids field of `ids` (b"" for none), or None when it passes 16 KiB."""
        varints = self._varints
        packed = b"".join([varints[t] if t < _TWO_BYTES else _varint(t) for t in ids])
        if len(packed) >= _TWO_BYTES:
            return None
        return _TOKEN_IDS + varints[len(packed)] + packed if packed else b""


def delta_to_proto(delta: Delta, calls: list[ToolCall] = ()) -> pb.GenerateResponse:
    """The response of one delta; the last one carries `calls` (a request with tools: the parsed calls)."""
    msg = pb.GenerateResponse(request_id=delta.request_id, token_index=delta.token_index, text=delta.text,
                              token_ids=delta.token_ids, reasoning_content=delta.reasoning)
    if delta.logprobs:  # most requests ask for none: no empty list built and converted per message
        msg.logprobs.extend(pb.TokenLogprob(logprob=lp.logprob, top=[pb.TopLogprob(token_id=i, logprob=v)
                                                                     for i, v in zip(lp.top_ids, lp.top_logprobs)])
                            for lp in delta.logprobs)
    if delta.finish_reason is not None:
        msg.finish_reason = int(delta.finish_reason)
        msg.route = delta.route
        u, t = delta.usage, delta.timings
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    cached_tokens=u.cached_tokens))
        msg.timings.CopyFrom(pb.Timings(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, total_ms=t.total_ms))
        msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
    return msg
