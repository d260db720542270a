"""The router's side of the guarded dispatch: messages for request ids it never sent are dropped and
counted; late outputs of a request it ended are not errors; health follows readiness both ways."""

from __future__ import annotations

import pytest

from hybridgate.models import model_fingerprint
from hybridgate.router import Router
from hybridgate.wire import EngineStats, Outputs, RequestError, SamplingParams, SeqOutput, WorkerState
from scripted import ScriptedClient

pytestmark = pytest.mark.asyncio


async def test_unknown_request_ids_are_counted_late_ones_are_not(gguf_model):
    client = ScriptedClient(model_fingerprint(gguf_model), [10, 11, 12])
    async with Router(gguf_model, [client]) as router:
        async with router.generate("Hello", SamplingParams(max_tokens=3)) as stream:
            done = [d async for d in stream]
        assert done[-1].finish_reason is not None and router.wire_errors == 0
        router._on_message(client, Outputs([SeqOutput(stream.request_id, 3, [13])], EngineStats()))  # late: fine
        assert router.wire_errors == 0
        router._on_message(client, Outputs([SeqOutput("never-sent", 0, [1])], EngineStats()))
        router._on_message(client, RequestError("never-sent-either", "boom"))
        assert router.wire_errors == 2


async def test_health_follows_readiness_both_ways(gguf_model):
    client = ScriptedClient(model_fingerprint(gguf_model), [10])
    changes: list[bool] = []
    async with Router(gguf_model, [client], on_ready_change=changes.append) as router:
        assert changes == [True]
        client.lost("gone")  # its lifecycle: DEAD, and the router hears of it
        assert client.state == WorkerState.DEAD and changes == [True, False]
        client.back()  # re-admitted: a HELLO of the same boot
        assert client.state == WorkerState.READY and changes == [True, False, True]
