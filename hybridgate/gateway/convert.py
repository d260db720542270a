"""Protobuf stops here: requests to plain Python values (validated), deltas to responses."""

from __future__ import annotations

from hybridgate.router import Delta
from hybridgate.router.router import Prompt
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import InvalidFieldError, SamplingParams


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


def request_to_native(req: pb.GenerateRequest) -> tuple[Prompt, SamplingParams]:
    """(prompt or messages, sampling params) of a request, as plain Python values.

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
        prompt = [{"role": m.role, "content": m.content} for m in req.chat.messages]
    return prompt, _sampling_params(req)


def delta_to_proto(delta: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=delta.request_id, token_index=delta.token_index, text=delta.text,
                              token_ids=delta.token_ids)
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
    return msg
