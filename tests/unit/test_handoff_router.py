"""The router's hand-off state machine (hybridgate/router/handoff.py): one test per transition of
its table, with fake worker clients; the reorder buffer against the stream it must reproduce."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.clients.interface import WorkerDead
from hybridgate.router.handoff import Handoff, HandoffMetrics, HandoffState, PauseHook
from hybridgate.router.reorder import Reorder
from hybridgate.wire import (
    Abort,
    AddRequest,
    HandoffExported,
    HandoffExportFailed,
    HandoffImported,
    HandoffRefused,
    HandoffRelease,
    HandoffReservation,
    HandoffReserve,
    HandoffResume,
    HandoffTarget,
    Hello,
    SamplingParams,
    SeqOutput,
)

RID = "r1"
S = HandoffState


class FakeClient:
    def __init__(self, kind: str, name: str):
        self.kind, self.endpoint = kind, f"ipc:///tmp/{name}"
        self.hello = Hello(kind, "fp", 8, 8192, 0, True, name=name,
                           handoff_endpoint=f"ipc:///tmp/{name}-handoff" if kind == "cpu" else "")
        self.sent = []  # ("add" | "abort" | "send", message)

    def add(self, request):
        self.sent.append(("add", request))

    def abort(self, request_ids):
        self.sent.append(("abort", Abort(request_ids)))

    def send(self, msg):
        self.sent.append(("send", msg))


class FakeSink:
    request_id = RID

    def __init__(self):
        self.items, self.moves = [], []

    def put(self, item):
        self.items.append(item)

    def moved(self, old, new):
        self.moves.append((old, new))


class FakeTimer:
    def __init__(self, when: float, callback, args):
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self):
        self.cancelled = True


class FakeClock:
    """A hand-off's clock that moves only when the test says: `advance` runs the timers due, in order."""

    def __init__(self):
        self.t, self.timers = 100.0, []

    def now(self) -> float:
        return self.t

    def call_later(self, delay_s: float, callback, *args) -> FakeTimer:
        timer = FakeTimer(self.t + delay_s, callback, args)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        end = self.t + seconds
        while due := [t for t in self.timers if not t.cancelled and t.when <= end]:
            timer = min(due, key=lambda t: t.when)  # the first of equal times: the one set first
            self.timers.remove(timer)
            self.t = timer.when
            timer.callback(*timer.args)
        self.t = end


def make(pause: PauseHook | None = None, stall_s: float = 5.0, answer_s: float = 10.0, clock: FakeClock | None = None):
    gpu, cpu, sink, metrics = FakeClient("gpu", "gpu-0"), FakeClient("cpu", "cpu-1"), FakeSink(), HandoffMetrics()
    request = AddRequest(RID, [5, 6, 7], SamplingParams(temperature=0), seed=1, max_tokens=8, eos_token_id=2)
    h = Handoff(sink, request, gpu, cpu, metrics, pause or PauseHook(), stall_s, answer_s, clock)
    h.start()
    return h, gpu, cpu, sink, metrics


def walk(h, gpu, cpu, to: HandoffState):
    """Drive a fresh hand-off to state `to` along the good path."""
    steps = [(cpu, HandoffReservation(RID, True, token="tok")), (gpu, HandoffExported(RID, 100, 1.0)),
             (cpu, HandoffImported(RID, 1))]
    order = [S.RESERVING, S.PREFILLING, S.EXPORTED, S.DECODING_ON_CPU]
    for client, msg in steps[: order.index(to)]:
        h.on_message(client, msg)
    assert h.state == to


async def test_reserve_is_sent_for_prompt_plus_one_then_add_carries_the_target():
    h, gpu, cpu, sink, _ = make()
    assert cpu.sent == [("send", HandoffReserve(RID, 4))] and gpu.sent == [] and h.state == S.RESERVING
    h.on_message(cpu, HandoffReservation(RID, True, token="tok"))
    (kind, add), = gpu.sent
    assert kind == "add" and add.handoff == HandoffTarget("ipc:///tmp/cpu-1-handoff", "tok")
    assert add.prompt_ids == [5, 6, 7] and h.state == S.PREFILLING


async def test_refused_reservation_runs_as_gpu_and_the_route_says_so():
    h, gpu, cpu, sink, metrics = make()
    h.on_message(cpu, HandoffReservation(RID, False, reason="no free KV blocks"))
    (kind, add), = gpu.sent
    assert kind == "add" and add.handoff is None and h.state == S.ON_GPU
    assert h.route() == "gpu (hand-off refused: no free KV blocks; gpu-0)"
    assert metrics.outcomes == {"done": 0, "refused": 1, "aborted": 0, "resumed": 0}


async def test_cpu_lost_while_reserving_runs_as_gpu():
    h, gpu, cpu, sink, metrics = make()
    h.on_message(cpu, WorkerDead("cpu silent"))
    assert [k for k, _ in gpu.sent] == ["add"] and h.state == S.ON_GPU and metrics.outcomes["refused"] == 1
    h.on_message(cpu, HandoffReservation(RID, True, token="late"))  # stale: ignored
    assert len(gpu.sent) == 1


async def test_gpu_lost_while_reserving_frees_the_reservation_and_hands_the_loss_to_the_stream():
    h, gpu, cpu, sink, _ = make()
    dead = WorkerDead("gpu silent")
    h.on_message(gpu, dead)
    assert cpu.sent[-1] == ("abort", Abort([RID])) and sink.items == [dead] and h.state == S.CLOSED


async def test_export_then_import_releases_the_gpu_and_moves_the_stream():
    clock = FakeClock()
    h, gpu, cpu, sink, metrics = make(clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)  # HandoffExported says the export started 1 ms before it
    clock.advance(0.25)
    h.on_message(cpu, HandoffImported(RID, 1))
    assert gpu.sent[-1] == ("send", HandoffRelease(RID)) and h.state == S.DECODING_ON_CPU
    assert sink.moves == [(gpu, cpu)] and h.route() == "gpu->cpu (gpu-0 -> cpu-1)"
    assert metrics.outcomes["done"] == 1 and metrics.seconds_count == 1
    assert metrics.seconds_sum == pytest.approx(0.251)


async def test_import_reported_before_export_counts_as_export_then_import():
    clock = FakeClock()
    h, gpu, cpu, sink, metrics = make(clock=clock)
    walk(h, gpu, cpu, S.PREFILLING)
    h.on_message(cpu, HandoffImported(RID, 1))  # C's message overtook G's HandoffExported
    assert h.state == S.DECODING_ON_CPU and gpu.sent[-1] == ("send", HandoffRelease(RID))
    assert metrics.outcomes["done"] == 1 and metrics.seconds_count == 0
    clock.advance(0.01)
    h.on_message(gpu, HandoffExported(RID, 100, export_ms=30.0))  # late: only the clock
    # The export started 30 ms before its message, which came 10 ms after the import: 20 ms from export to import.
    assert h.state == S.DECODING_ON_CPU and metrics.seconds_count == 1
    assert metrics.seconds_sum == pytest.approx(0.02)


async def test_an_overtaking_import_still_meets_the_exported_pause():
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED:5"}))
    walk(h, gpu, cpu, S.PREFILLING)
    h.on_message(cpu, HandoffImported(RID, 1))
    assert h.state == S.EXPORTED and ("send", HandoffRelease(RID)) not in gpu.sent
    h.on_message(cpu, WorkerDead("cpu killed"))  # the window the kill test uses
    assert h.state == S.ON_GPU and gpu.sent[-1] == ("send", HandoffResume(RID))


@pytest.mark.parametrize("failure", ["refused", "lost"])
async def test_cpu_failure_after_export_resumes_on_the_gpu(failure):
    h, gpu, cpu, sink, metrics = make()
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffRefused(RID, "fingerprint", "a != b") if failure == "refused" else WorkerDead("x"))
    assert gpu.sent[-1] == ("send", HandoffResume(RID)) and h.state == S.ON_GPU and sink.items == []
    assert metrics.outcomes["resumed"] == 1 and h.route().startswith("gpu (hand-off ")


@pytest.mark.parametrize("failure", ["refused", "lost"])
async def test_cpu_failure_before_export_resumes_once_the_gpu_says_it_exported(failure):
    h, gpu, cpu, sink, metrics = make()
    walk(h, gpu, cpu, S.PREFILLING)
    h.on_message(cpu, HandoffRefused(RID, "token", "spent") if failure == "refused" else WorkerDead("x"))
    assert gpu.sent[-1][0] == "add" and h.state == S.PREFILLING  # nothing parked yet: nothing to resume
    h.on_message(gpu, HandoffExported(RID, 100, 1.0))
    assert gpu.sent[-1] == ("send", HandoffResume(RID)) and h.state == S.ON_GPU


@pytest.mark.parametrize(("reason", "counted"), [("no pinned buffer", 1), ("finished", 0)])
async def test_export_failed_frees_the_reservation_and_stays_on_gpu(reason, counted):
    h, gpu, cpu, sink, metrics = make()
    walk(h, gpu, cpu, S.PREFILLING)
    h.on_message(gpu, HandoffExportFailed(RID, reason))
    assert cpu.sent[-1] == ("abort", Abort([RID])) and h.state == S.ON_GPU
    assert metrics.outcomes["refused"] == counted


async def test_gpu_lost_after_export_lets_the_import_finish():
    h, gpu, cpu, sink, _ = make()
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(gpu, WorkerDead("gpu silent"))
    assert h.state == S.EXPORTED and sink.items == []
    h.on_message(cpu, HandoffImported(RID, 1))
    assert h.state == S.DECODING_ON_CPU and sink.moves == [(gpu, cpu)]


async def test_gpu_lost_after_export_then_cpu_refusal_hands_the_loss_to_the_stream():
    h, gpu, cpu, sink, _ = make()
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(gpu, WorkerDead("gpu silent"))
    h.on_message(cpu, HandoffRefused(RID, "dtype", "x"))
    assert h.state == S.CLOSED and isinstance(sink.items[-1], WorkerDead)


async def test_cpu_lost_after_import_hands_the_loss_to_the_stream():
    h, gpu, cpu, sink, _ = make()
    walk(h, gpu, cpu, S.DECODING_ON_CPU)
    dead = WorkerDead("cpu silent")
    h.on_message(cpu, dead)
    assert sink.items == [dead] and h.state == S.CLOSED
    assert ("send", HandoffResume(RID)) not in gpu.sent  # the GPU released it: re-prefill, not resume


async def test_gpu_lost_while_prefilling_hands_the_loss_to_the_stream():
    h, gpu, cpu, sink, metrics = make()
    walk(h, gpu, cpu, S.PREFILLING)
    h.on_message(gpu, WorkerDead("gpu silent"))
    assert cpu.sent[-1] == ("abort", Abort([RID])) and isinstance(sink.items[-1], WorkerDead)
    assert metrics.outcomes["aborted"] == 1


@pytest.mark.parametrize("state", [S.RESERVING, S.PREFILLING, S.EXPORTED, S.DECODING_ON_CPU], ids=lambda s: s.name)
async def test_abort_in_every_state_goes_to_both_workers_once(state):
    h, gpu, cpu, sink, metrics = make()
    walk(h, gpu, cpu, state)
    moves = list(sink.moves)
    h.abort()
    h.abort()
    assert gpu.sent[-1] == cpu.sent[-1] == ("abort", Abort([RID]))
    assert sum(k == "abort" for k, _ in gpu.sent + cpu.sent) == 2 and h.state == S.CLOSED
    assert metrics.outcomes["aborted"] == (state != S.DECODING_ON_CPU)
    h.on_message(cpu, HandoffImported(RID, 1))  # after the abort: ignored
    assert h.state == S.CLOSED and sink.moves == moves


async def test_outputs_of_both_workers_are_reordered_and_deduplicated():
    h, gpu, cpu, sink, _ = make()
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffImported(RID, 1))
    h.on_message(cpu, SeqOutput(RID, 2, [12, 13]))
    h.on_message(cpu, SeqOutput(RID, 1, [11]))
    h.on_message(gpu, SeqOutput(RID, 0, [10]))
    h.on_message(gpu, SeqOutput(RID, 0, [10]))
    assert [(o.token_index, o.token_ids) for o in sink.items] == [(0, [10]), (1, [11]), (2, [12, 13])]


async def test_cpu_outputs_wait_for_the_confirmed_import_and_are_dropped_on_resume():
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED:5"}))
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(gpu, SeqOutput(RID, 0, [10]))
    h.on_message(cpu, HandoffImported(RID, 1))  # held by the pause
    h.on_message(cpu, SeqOutput(RID, 1, [11]))  # C decodes already: not the stream's yet
    assert [o.token_ids for o in sink.items] == [[10]]
    h.on_message(cpu, WorkerDead("cpu killed"))
    assert gpu.sent[-1] == ("send", HandoffResume(RID)) and h.state == S.ON_GPU
    h.on_message(gpu, SeqOutput(RID, 1, [21]))
    assert [o.token_ids for o in sink.items] == [[10], [21]]


async def test_a_loss_during_a_pause_ends_it_and_the_new_state_is_not_paused():
    clock = FakeClock()
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED:5"}),
                                answer_s=0.05, clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffImported(RID, 1))  # held by the pause
    h.on_message(cpu, WorkerDead("cpu killed"))
    assert h.state == S.ON_GPU and gpu.sent[-1] == ("send", HandoffResume(RID))
    await asyncio.sleep(0)  # the stale import is offered to ON_GPU (call_soon), which ignores it
    clock.advance(10)  # past the pause and any answer timer
    assert h.state == S.ON_GPU and sink.moves == [] and not h.imported


async def test_cpu_outputs_before_the_import_message_are_passed_on_once_it_arrives():
    h, gpu, cpu, sink, _ = make()
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(gpu, SeqOutput(RID, 0, [10]))
    h.on_message(cpu, SeqOutput(RID, 1, [11]))
    assert len(sink.items) == 1
    h.on_message(cpu, HandoffImported(RID, 1))
    assert [o.token_ids for o in sink.items] == [[10], [11]]


async def test_a_gap_that_does_not_fill_within_the_stall_timeout_is_a_lost_worker():
    clock = FakeClock()
    h, gpu, cpu, sink, _ = make(stall_s=0.05, clock=clock)
    walk(h, gpu, cpu, S.DECODING_ON_CPU)
    h.on_message(cpu, SeqOutput(RID, 2, [12]))
    clock.advance(0.049)
    assert sink.items == [] and h.state == S.DECODING_ON_CPU
    clock.advance(0.001)
    assert isinstance(sink.items[-1], WorkerDead) and "index 0" in sink.items[-1].reason and h.state == S.CLOSED


async def test_a_gap_that_fills_in_time_is_not_a_loss():
    clock = FakeClock()
    h, gpu, cpu, sink, _ = make(stall_s=0.2, clock=clock)
    walk(h, gpu, cpu, S.DECODING_ON_CPU)
    h.on_message(cpu, SeqOutput(RID, 1, [11]))
    clock.advance(0.199)
    h.on_message(gpu, SeqOutput(RID, 0, [10]))
    clock.advance(1)
    assert [o.token_ids for o in sink.items] == [[10], [11]] and h.state == S.DECODING_ON_CPU


async def test_a_silent_cpu_worker_counts_as_refusing_the_reservation():
    clock = FakeClock()
    h, gpu, cpu, sink, metrics = make(answer_s=0.05, clock=clock)
    clock.advance(0.049)
    assert h.state == S.RESERVING and gpu.sent == []
    clock.advance(0.001)
    assert h.state == S.ON_GPU and [k for k, _ in gpu.sent] == ["add"] and cpu.sent[-1] == ("abort", Abort([RID]))
    assert "did not answer within 0.05 s" in h.route() and metrics.outcomes["refused"] == 1


async def test_a_silent_cpu_worker_after_export_resumes_on_the_gpu():
    clock = FakeClock()
    h, gpu, cpu, sink, metrics = make(answer_s=0.05, clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)
    clock.advance(0.049)
    assert h.state == S.EXPORTED
    clock.advance(0.001)
    assert h.state == S.ON_GPU and gpu.sent[-1] == ("send", HandoffResume(RID)) and metrics.outcomes["resumed"] == 1
    assert cpu.sent[-1] == ("abort", Abort([RID]))


async def test_the_answer_timer_starts_after_a_pause():
    clock = FakeClock()
    pause = PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED:0.2"})
    h, gpu, cpu, sink, _ = make(pause, answer_s=0.15, clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)
    [held] = [t for t in clock.timers if not t.cancelled]  # the pause: 0.1-0.2 s, drawn when EXPORTED began
    assert 0.1 <= held.when - clock.now() <= 0.2
    clock.advance(held.when - clock.now() + 0.149)  # the pause ended 149 ms ago: the answer timer has not fired
    assert h.state == S.EXPORTED and ("send", HandoffResume(RID)) not in gpu.sent
    h.on_message(cpu, HandoffImported(RID, 1))
    assert h.state == S.DECODING_ON_CPU


async def test_messages_from_another_worker_are_ignored():
    h, gpu, cpu, sink, _ = make()
    h.on_message(FakeClient("cpu", "cpu-9"), HandoffReservation(RID, True, token="x"))
    assert h.state == S.RESERVING and gpu.sent == []


def test_pause_hook_parses_and_names_its_variable():
    hook = PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED+IMPORTED:0.4:7"})
    assert hook.states == {S.EXPORTED, S.IMPORTED} and hook.seed == 7
    assert all(0.2 <= hook.seconds(S.EXPORTED) <= 0.4 for _ in range(50)) and hook.seconds(S.RESERVING) == 0
    assert PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "all:1"}).states == {
        S.RESERVING, S.PREFILLING, S.EXPORTED, S.IMPORTED}
    assert PauseHook.from_env({}).seconds(S.EXPORTED) == 0
    with pytest.raises(ValueError, match="HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE"):
        PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "NOWHERE:1"})


async def test_pause_holds_the_state_and_its_control_events_until_it_ends():
    clock = FakeClock()
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "IMPORTED:0.1"}),
                                clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffImported(RID, 1))
    assert h.state == S.IMPORTED and ("send", HandoffRelease(RID)) not in gpu.sent  # the window tests cancel in
    clock.advance(0.049)  # the pause lasts at least half its 0.1 s
    assert h.state == S.IMPORTED
    clock.advance(0.051)
    assert h.state == S.DECODING_ON_CPU and gpu.sent[-1] == ("send", HandoffRelease(RID))


async def test_abort_during_a_pause_wins_over_the_held_transition():
    clock = FakeClock()
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "EXPORTED:0.05"}),
                                clock=clock)
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffImported(RID, 1))  # held by the pause
    h.abort()
    clock.advance(1)
    assert h.state == S.CLOSED and ("send", HandoffRelease(RID)) not in gpu.sent and sink.moves == []


async def test_stream_finishing_in_a_held_import_frees_the_parked_sequence():
    h, gpu, cpu, sink, _ = make(PauseHook.from_env({"HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "IMPORTED:5"}))
    walk(h, gpu, cpu, S.EXPORTED)
    h.on_message(cpu, HandoffImported(RID, 1))
    h.finished()
    assert gpu.sent[-1] == ("abort", Abort([RID])) and h.state == S.CLOSED


# --- the reorder buffer against the stream it must reproduce ---------------------


def _chunks(ids: list[int], cuts: list[int], first: int = 0) -> list[SeqOutput]:
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {0, len(ids)})
    return [SeqOutput(RID, first + a, ids[a:b], finish=3 if b == len(ids) else 0) for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 99), min_size=1, max_size=40), cuts_a=st.lists(st.integers(0, 40)),
       cuts_b=st.lists(st.integers(0, 40)), seed=st.integers(0, 2**32 - 1))
def test_reorder_reproduces_the_stream_from_two_overlapping_shuffled_sources(ids, cuts_a, cuts_b, seed):
    # Two workers send the same ids split differently, each chunk maybe twice, in any order.
    rng = random.Random(seed)
    arrivals = _chunks(ids, cuts_a) + _chunks(ids, cuts_b)
    arrivals += rng.sample(arrivals, k=len(arrivals) // 2)
    rng.shuffle(arrivals)
    reorder, got = Reorder(), []
    for out in arrivals:
        got += reorder.push(out)
    assert [t for o in got for t in o.token_ids] == ids
    assert [o.token_index for o in got] == [sum(len(p.token_ids) for p in got[:i]) for i in range(len(got))]
    assert [bool(o.finish) for o in got] == [False] * (len(got) - 1) + [True]
    assert reorder.gap_since is None


def test_router_metrics_render_with_their_names_and_buckets():
    from prometheus_client import generate_latest

    from hybridgate.gateway.metrics import GatewayMetrics

    m = HandoffMetrics()
    m.outcomes["done"] += 2
    m.outcomes["refused"] += 1
    for s in (0.004, 0.04, 3.0):
        m.observe(s)
    # Two models' routers, one gateway: the same series, counted once per hand-off whichever model made it.
    n = HandoffMetrics()
    n.outcomes["done"] += 1
    n.observe(0.04)
    m.outcomes["done"] += 1
    text = generate_latest(GatewayMetrics(lambda: [], handoff=lambda: HandoffMetrics.summed([m, n])).registry).decode()
    for line in [
        'hybridgate:kv_handoff_total{direction="gpu_to_cpu",outcome="done"} 4.0',
        'hybridgate:kv_handoff_total{direction="gpu_to_cpu",outcome="refused"} 1.0',
        'hybridgate:kv_handoff_total{direction="gpu_to_cpu",outcome="aborted"} 0.0',
        'hybridgate:kv_handoff_seconds_bucket{direction="gpu_to_cpu",le="0.005"} 1.0',
        'hybridgate:kv_handoff_seconds_bucket{direction="gpu_to_cpu",le="0.05"} 3.0',
        'hybridgate:kv_handoff_seconds_bucket{direction="gpu_to_cpu",le="2.5"} 3.0',
        'hybridgate:kv_handoff_seconds_bucket{direction="gpu_to_cpu",le="+Inf"} 4.0',
        'hybridgate:kv_handoff_seconds_count{direction="gpu_to_cpu"} 4.0',
        'hybridgate:kv_handoff_seconds_sum{direction="gpu_to_cpu"} 3.084',
    ]:
        assert line in text, line
