"""Routes through the Router (auto, gpu, cpu, gpu->cpu) over scripted workers that speak the
hand-off protocol: which worker serves each token, what the final route says, and that the
stream the client sees is the script, once, whichever way the hand-off ends."""

from __future__ import annotations

import asyncio

import pytest

from hybridgate.models import model_fingerprint
from hybridgate.router import InvalidRequestError, Router, UnavailableError
from hybridgate.clients.local import LocalWorkerClient
from hybridgate.wire import (
    EngineStats,
    FinishReason,
    HandoffExported,
    HandoffImported,
    HandoffRefused,
    HandoffRelease,
    HandoffReservation,
    HandoffReserve,
    HandoffResume,
    Hello,
    Outputs,
    SamplingParams,
    SeqOutput,
)

SCRIPT = [101, 102, 103, 104, 105, 106]


class Scripted(LocalWorkerClient):
    """A worker that plays SCRIPT; the GPU one exports after token 0 when asked, the CPU one imports."""

    def __init__(self, fp: str, kind: str, name: str, *, refuse_reserve: str = "", refuse_import: str = ""):
        self.kind, self.endpoint = kind, f"scripted://{name}"
        self.stats = EngineStats()
        self.hello = Hello(kind, fp, 8, 8192, 0, True, name=name,
                           handoff_endpoint=f"ipc:///tmp/{name}-h" if kind == "cpu" else "")
        self.refuse_reserve, self.refuse_import = refuse_reserve, refuse_import
        self.peer: Scripted | None = None
        self.added, self.aborted, self.got = [], [], []  # got: hand-off messages from the router
        self._requests = {}

    async def start(self, on_message) -> None:
        self._on = on_message
        self._start_lifecycle(on_message)
        self.come_up()

    def _later(self, msg) -> None:
        asyncio.get_running_loop().call_soon(self._on, self, msg)

    def _play(self, rid: str, start: int) -> None:
        for i in range(start, len(SCRIPT)):
            last = i == len(SCRIPT) - 1
            self._later(Outputs([SeqOutput(rid, i, [SCRIPT[i]], finish=int(FinishReason.LENGTH) if last else 0)],
                                self.stats))

    def add(self, request) -> None:
        self.added.append(request)
        self._requests[request.request_id] = request
        if request.handoff is None:
            self._play(request.request_id, 0)
            return
        self._later(Outputs([SeqOutput(request.request_id, 0, [SCRIPT[0]])], self.stats))
        self._later(HandoffExported(request.request_id, nbytes=1000, export_ms=1.0))
        asyncio.get_running_loop().call_soon(self.peer.receive_kv, request)

    def receive_kv(self, request) -> None:
        if self.refuse_import:
            self._later(HandoffRefused(request.request_id, "fingerprint", self.refuse_import))
            return
        self._later(HandoffImported(request.request_id, 1))
        self._play(request.request_id, 1)

    def send(self, msg) -> None:
        self.got.append(msg)
        if isinstance(msg, HandoffReserve):
            ok = not self.refuse_reserve
            self._later(HandoffReservation(msg.request_id, ok, token="t" if ok else "", reason=self.refuse_reserve))
        elif isinstance(msg, HandoffResume):
            self._play(msg.request_id, 1)

    def abort(self, request_ids) -> None:
        self.aborted += request_ids

    async def close(self) -> None:
        pass


def pair(fp, **cpu_kw):
    gpu, cpu = Scripted(fp, "gpu", "gpu-0"), Scripted(fp, "cpu", "cpu-1", **cpu_kw)
    gpu.peer = cpu
    return gpu, cpu


async def run(router, route, **params):
    async with router.generate("x", SamplingParams(temperature=0, max_tokens=6, **params), route=route) as stream:
        return [d async for d in stream]


def contiguous(deltas) -> bool:
    """Each delta starts where the ones before it ended (queued outputs may be joined into one)."""
    return [d.token_index for d in deltas] == [sum(len(x.token_ids) for x in deltas[:k]) for k in range(len(deltas))]


def ids(deltas):
    return [t for d in deltas for t in d.token_ids]


async def test_gpu_to_cpu_streams_token_0_from_the_gpu_and_the_rest_from_the_cpu(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model))
    async with Router(gguf_model, [gpu, cpu]) as router:
        deltas = await run(router, "gpu->cpu")
        assert ids(deltas) == SCRIPT and contiguous(deltas)
        assert deltas[-1].route == "gpu->cpu (gpu-0 -> cpu-1)"
        assert [type(m) for m in gpu.got] == [HandoffRelease] and [type(m) for m in cpu.got] == [HandoffReserve]
        assert cpu.got[0].num_tokens == len(router.tokenize("x")) + 1
        assert router.handoff_metrics.outcomes["done"] == 1 and router.handoff_metrics.seconds_count == 1
        assert router.placer.inflight(gpu) == router.placer.inflight(cpu) == 0


async def test_a_refused_reservation_runs_as_gpu_and_the_route_says_so(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model), refuse_reserve="no free KV blocks (0 free, 1 needed)")
    async with Router(gguf_model, [gpu, cpu]) as router:
        deltas = await run(router, "gpu->cpu")
        assert ids(deltas) == SCRIPT and gpu.added[0].handoff is None
        assert deltas[-1].route == "gpu (hand-off refused: no free KV blocks (0 free, 1 needed); gpu-0)"
        assert router.handoff_metrics.outcomes["refused"] == 1


async def test_a_refused_import_resumes_on_the_gpu_with_no_token_lost_or_repeated(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model), refuse_import="a != b")
    async with Router(gguf_model, [gpu, cpu]) as router:
        deltas = await run(router, "gpu->cpu")
        assert ids(deltas) == SCRIPT and contiguous(deltas)
        assert [type(m) for m in gpu.got] == [HandoffResume]
        assert deltas[-1].route.startswith("gpu (hand-off refused: fingerprint: a != b")
        assert router.handoff_metrics.outcomes["resumed"] == 1


async def test_one_kind_routes_pick_that_kind(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model))
    async with Router(gguf_model, [gpu, cpu]) as router:
        assert (await run(router, "cpu"))[-1].route == "cpu (cpu-1)" and cpu.added and not gpu.added
        assert (await run(router, "gpu"))[-1].route == "gpu (gpu-0)" and gpu.added


async def test_unknown_route_names_the_field_and_the_allowed_values(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model))
    async with Router(gguf_model, [gpu, cpu]) as router:
        with pytest.raises(InvalidRequestError, match=r"route: must be one of auto, gpu, cpu, gpu->cpu, got 'tpu'"):
            router.generate("x", route="tpu")


@pytest.mark.parametrize("route", ["cpu", "gpu->cpu"])
async def test_a_route_without_a_ready_worker_of_its_kind_is_unavailable(gguf_model, route):
    gpu, _ = pair(model_fingerprint(gguf_model))
    async with Router(gguf_model, [gpu]) as router:
        with pytest.raises(UnavailableError, match="no cpu worker is ready"):
            await run(router, route)
        assert not gpu.added and router.placer.inflight(gpu) == 0


async def test_abort_mid_hand_off_goes_to_both_workers(gguf_model):
    gpu, cpu = pair(model_fingerprint(gguf_model))
    async with Router(gguf_model, [gpu, cpu]) as router:
        async with router.generate("x", SamplingParams(max_tokens=6), route="gpu->cpu") as stream:
            async for _ in stream:
                break
        assert stream.request_id in gpu.aborted and stream.request_id in cpu.aborted
