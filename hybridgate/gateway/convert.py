"""Protobuf stops here: requests to plain Python values (validated), deltas to responses."""

from __future__ import annotations

from hybridgate.router import Delta
from hybridgate.router.router import MAX_PROMPT_BYTES, Prompt
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import InvalidFieldError, SamplingParams


def request_to_native(req: pb.GenerateRequest) -> tuple[Prompt, SamplingParams]:
    """(prompt or messages, sampling params) of a request.

    Raises:
        InvalidFieldError: naming the field and its limit.
    """
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidFieldError("prompt", "must not be empty (set prompt or chat)")
    if which == "prompt":
        prompt: Prompt = req.prompt
        if not prompt:
            raise InvalidFieldError("prompt", "must not be empty")
        if len(prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
            raise InvalidFieldError("prompt", f"at most 1 MiB ({MAX_PROMPT_BYTES} bytes), got "
                                    f"{len(prompt.encode('utf-8'))} bytes")
    else:
        prompt = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not prompt:
            raise InvalidFieldError("chat.messages", "at least one message is required")
        if not any(m["content"].strip() for m in prompt):
            raise InvalidFieldError("chat.messages", "every message content is empty")
    if req.HasField("max_tokens") and req.max_tokens == 0:
        raise InvalidFieldError("max_tokens", "must be >= 1, got 0")
    params = SamplingParams(
        temperature=req.temperature if req.HasField("temperature") else 1.0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        seed=req.seed if req.HasField("seed") else None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
    )
    return prompt, params.validate()


def delta_to_proto(delta: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=delta.request_id, token_index=delta.token_index, text=delta.text, token_ids=delta.token_ids
    )
    if delta.finish_reason is not None:
        msg.finish_reason = int(delta.finish_reason)
        msg.route = delta.route
        u, t = delta.usage, delta.timings
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    cached_tokens=u.cached_tokens))
        msg.timings.CopyFrom(pb.Timings(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, total_ms=t.total_ms))
    return msg
