"""Protobuf stops here: requests to plain Python values (validated), deltas to responses."""

from __future__ import annotations

from hybridgate.router import Delta
from hybridgate.router.router import Prompt
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import InvalidFieldError, SamplingParams


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
    params = SamplingParams(
        temperature=req.temperature if req.HasField("temperature") else 1.0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        seed=req.seed if req.HasField("seed") else None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        presence_penalty=req.presence_penalty if req.HasField("presence_penalty") else 0.0,
        frequency_penalty=req.frequency_penalty if req.HasField("frequency_penalty") else 0.0,
        min_p=req.min_p if req.HasField("min_p") else 0.0,
        stop_token_ids=tuple(req.stop_token_ids),
        logprobs=req.logprobs if req.HasField("logprobs") else None,
    )
    return prompt, params


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
