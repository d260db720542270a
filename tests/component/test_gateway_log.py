"""The request log of an in-process gateway over a scripted worker: one line per request."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.models import model_fingerprint
from hybridgate.router import Router
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import FinishReason
from conftest import TIME_FACTOR
from scripted import ScriptedClient

pytestmark = pytest.mark.asyncio

PROMPT = "A secret prompt about Paris"


@pytest.mark.parametrize("with_text", [False, True])
async def test_one_line_per_request_with_the_prompt_only_when_asked(gguf_model, tokenizer, caplog, with_text):
    script = tokenizer.encode(" It is sunny.")
    client = ScriptedClient(model_fingerprint(gguf_model), script, finish=FinishReason.LENGTH)
    config = GatewayConfig(port=0, http_port=0, log_requests=True, log_request_text=with_text)
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


async def test_every_cancelled_call_is_counted_and_logged_as_abort(gguf_model, tokenizer, caplog):
    # grpc.aio cancels a call wherever its task waits: in the router's queue (CancelledError inside
    # the handler) or in its own write of a response (the handler's generator is closed later, with
    # GeneratorExit). A scripted worker that streams without pause puts many cancels in the second.
    script = tokenizer.encode(" word" * 2000)
    client = ScriptedClient(model_fingerprint(gguf_model), script, finish=FinishReason.LENGTH)
    calls = 12
    async with Router(gguf_model, [client]) as router:
        gateway = Gateway(router, GatewayConfig(port=0, http_port=0, log_requests=True))
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                for _ in range(calls):
                    call = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=len(script)))
                    received = 0
                    async for _message in call:
                        received += 1
                        if received == 3:
                            call.cancel()
                            break
            await wait_for_lines(caplog, calls)
            aborted = gateway.metrics.registry.get_sample_value(
                "hybridgate:request_success_total", {"finished_reason": "abort", "model_name": gateway.model_names[0]})
        finally:
            await gateway.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridgate.requests"]
    # A stream can still end whole before the cancel reaches the server (the gateway coalesces queued ids,
    # so the client's third message may hold most of them): that call was not cancelled there.
    whole = f"completion_tokens={len(script)} "
    cancelled = [line for line in lines if "finish_reason=abort status=CANCELLED" in line]
    finished = [line for line in lines if whole in line and "finish_reason=length status=OK" in line]
    assert len(lines) == calls and len(cancelled) + len(finished) == calls, lines
    assert len(cancelled) >= calls // 2, lines
    assert aborted == len(cancelled)


async def wait_for_lines(caplog, count: int, timeout: float = 10.0) -> None:
    """Until `count` request-log lines were written (a cancelled handler ends after the client moved on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout * TIME_FACTOR
    while sum(r.name == "hybridgate.requests" for r in caplog.records) < count:
        if loop.time() > deadline:
            raise AssertionError(f"fewer than {count} request-log lines after {timeout * TIME_FACTOR} s")
        await asyncio.sleep(0.01)
