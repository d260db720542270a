"""The request log of an in-process gateway over a scripted worker: one line per request."""

from __future__ import annotations

import logging

import grpc
import pytest

from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.models import model_fingerprint
from hybridgate.router import Router
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import FinishReason
from scripted import ScriptedClient

pytestmark = pytest.mark.asyncio

PROMPT = "A secret prompt about Paris"


@pytest.mark.parametrize("with_text", [False, True])
async def test_one_line_per_request_with_the_prompt_only_when_asked(gguf_model, tokenizer, caplog, with_text):
    script = tokenizer.encode(" It is sunny.")
    client = ScriptedClient(model_fingerprint(gguf_model), script, finish=FinishReason.LENGTH)
    config = GatewayConfig(port=0, log_requests=True, log_request_text=with_text)
    async with Router(gguf_model, [client]) as router:
        gateway = Gateway(router, config)
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, label="lbl"))
                messages = [m async for m in call]
        finally:
            await gateway.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridgate.requests"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"request id={messages[0].request_id} label='lbl' route=gpu ")
    assert f"prompt_tokens={len(tokenizer.encode(PROMPT))} completion_tokens={len(script)} " in line
    assert "finish_reason=length status=OK" in line
    assert (f"prompt={PROMPT!r}" in line) == with_text and ("secret" in line) == with_text
