"""A constrained stream whose worker is lost mid-stream resumes on the other worker (real engines, both
runners in process): the new worker rebuilds the matcher from the ids already streamed, and the caller's
one stream is JSON that validates against the schema (`jsonschema`)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from conftest import TIME_FACTOR
from hybridgate.models import model_fingerprint
from hybridgate.router.router import Router
from hybridgate.wire import Constraint, FinishReason, SamplingParams
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.inprocess import InProcessClient

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
GRAMMAR = "start: %json " + json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
LOSE_AFTER = 4  # ids streamed before the worker holding the stream is lost


def holder(clients: list[InProcessClient]) -> InProcessClient:
    """The client whose engine holds a live sequence."""
    return next(c for c in clients if c.engine.scheduler.running or c.engine.scheduler.waiting)


def test_a_lost_worker_resumes_a_constrained_stream_that_still_validates(gguf_model):
    fp = model_fingerprint(gguf_model)
    runners = [TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="32MiB"),
               NumbaRunner(gguf_model, kv_cache_memory="32MiB", threads=1)]
    runners[1].warm_up(progress=False)
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=48,
                            constraint=Constraint(kind="json_schema", grammar=GRAMMAR))
    chat = [{"role": "user", "content": "Plan a trip: give a city and a number of days as JSON."}]

    async def main():
        clients = [InProcessClient(r, fp) for r in runners]
        async with Router(gguf_model, clients) as router:
            deltas, lost = [], None
            async with router.generate(chat, params) as stream:
                async with asyncio.timeout(120 * TIME_FACTOR):
                    async for d in stream:
                        deltas.append(d)
                        if lost is None and sum(len(x.token_ids) for x in deltas) >= LOSE_AFTER:
                            lost = holder(clients)
                            lost._engine_loop.stopping.set()  # its engine stops: a dead worker sends nothing
                            lost.lost("killed by the test")
            return deltas, lost

    deltas, lost = asyncio.run(main())
    assert lost is not None and "resumed at token" in deltas[-1].route, deltas[-1].route
    assert deltas[-1].finish_reason == FinishReason.STOP
    ids = [t for d in deltas for t in d.token_ids]
    assert [d.token_index for d in deltas] == [sum(len(x.token_ids) for x in deltas[:i]) for i in range(len(deltas))]
    assert len(ids) > LOSE_AFTER
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)
