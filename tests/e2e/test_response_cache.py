"""The response cache with `--response-cache redis`, end to end: a worker and gateways as real processes, a real
redis-server. One worker and one Redis for the module; the gateway is restarted where only Redis may answer.

The number of generations comes from the worker's own step counters (`hybridgate:engine_steps_total` and the
sequence-steps of `hybridgate:engine_steps_by_batch_size_total`), never from the cache's counters alone.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from conftest import TIME_FACTOR, RedisServer, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, metrics, stub, wait_metric

FRANCE = golden_json("greedy.json")["france"]  # transformers' greedy ids for this chat (tests/reference)


class Gateway:
    def __init__(self, folder, endpoint: str, redis_url: str, name: str):
        self.proc = Proc(["gateway", "--port", "0", "--metrics-port", "0", "--worker", endpoint, "--redis-url",
                          redis_url, "--response-cache", "redis"], folder / f"{name}.log")
        port = self.proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = self.proc.wait_for(r"metrics on (http://\S+)").group(1)
        self.proc.wait_for(r"hybridgate: READY")
        self.stub = stub(self.target)

    def m(self, name: str) -> float:
        return metrics(self.metrics_url).get(name, 0.0)

    def worker_work(self) -> tuple[float, float]:
        """(engine steps, sequence-steps) once the worker is idle and its counters have settled."""
        deadline = time.monotonic() + 20 * TIME_FACTOR
        last = None
        while time.monotonic() < deadline:
            sample = metrics(self.metrics_url)
            now = (sample.get("hybridgate:engine_steps_total{}", 0.0),
                   sum(float(k.split("batch_size=")[1].split(",")[0].rstrip("}")) * v for k, v in sample.items()
                       if k.startswith("hybridgate:engine_steps_by_batch_size_total")))
            if sample.get("hybridgate:num_requests_running{}", 1) == 0 and now == last:
                return now
            last = now
            time.sleep(0.3)  # past two heartbeats (100 ms) with nothing new
        raise AssertionError("the worker did not go idle")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_path):
    folder = tmp_path_factory.mktemp("response-cache")
    redis = RedisServer(folder)
    endpoint = f"ipc://{folder}/w0.sock"
    worker = Proc(["worker", "--endpoint", endpoint, "--threads", "1", "--worker-name", "cpu-0"], folder / "worker.log")
    worker.wait_for(r"hybridgate worker: READY", 120)
    state = {"folder": folder, "redis": redis, "endpoint": endpoint, "n": 0}

    def new_gateway() -> Gateway:
        state["n"] += 1
        return Gateway(folder, endpoint, redis.url, f"gateway-{state['n']}")

    state["new_gateway"] = new_gateway
    state["gateway"] = new_gateway()
    try:
        yield state
    finally:
        state["gateway"].proc.stop()
        worker.stop()
        redis.stop()


def request(question: str, **fields) -> pb.GenerateRequest:
    fields.setdefault("temperature", 0)
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]), **fields)


def call(gw: Gateway, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(gw.stub.Generate(req, timeout=60 * TIME_FACTOR))


def shape(messages) -> list[tuple]:
    return [(m.token_index, m.text, list(m.token_ids)) for m in messages]


def test_hit_after_gateway_restart_replays_the_stream(stack):
    gw = stack["gateway"]
    req = request(FRANCE["question"], max_tokens=len(FRANCE["ids"]))
    first = call(gw, req)
    assert [i for m in first for i in m.token_ids] == FRANCE["ids"]
    assert first[-1].route.startswith("cpu (cpu-0)") and gw.m("hybridgate:response_cache_misses_total{}") == 1
    gw.proc.stop()
    gw = stack["gateway"] = stack["new_gateway"]()  # a new process: only Redis can answer
    steps = gw.worker_work()
    again = call(gw, req)
    assert shape(again) == shape(first) and len(again) == len(first)
    last = again[-1]
    assert last.route == "cache" and last.finish_reason == first[-1].finish_reason == pb.FINISH_REASON_EOS
    assert last.usage.prompt_tokens == first[-1].usage.prompt_tokens == len(FRANCE["prompt_ids"])
    assert last.usage.cached_tokens == last.usage.prompt_tokens
    assert last.usage.completion_tokens == len(FRANCE["ids"])
    assert gw.worker_work() == steps  # no generation ran
    assert gw.m("hybridgate:response_cache_hits_total{}") == 1 and gw.m("hybridgate:response_cache_bytes{}") == 0
    assert gw.m("hybridgate:redis_up{}") == 1


def test_any_changed_field_misses_and_sampled_requests_are_never_cached(stack):
    gw = stack["gateway"]
    base = dict(max_tokens=6)
    call(gw, request("Name a colour.", **base))
    hits, misses = gw.m("hybridgate:response_cache_hits_total{}"), gw.m("hybridgate:response_cache_misses_total{}")
    assert call(gw, request("Name a colour.", **base))[-1].route == "cache"
    variants = [dict(top_p=0.9), dict(top_k=5), dict(repetition_penalty=1.1), dict(seed=1), dict(stop=["zz"]),
                dict(max_tokens=5), dict(ignore_eos=True), dict(skip_special_tokens=False)]
    for fields in variants:
        answer = call(gw, request("Name a colour.", **{**base, **fields}))
        assert answer[-1].route != "cache", fields
    assert gw.m("hybridgate:response_cache_misses_total{}") == misses + len(variants)
    sampled = [call(gw, request("Name a colour.", max_tokens=6, temperature=0.8)) for _ in range(2)]
    assert all(a[-1].route != "cache" for a in sampled)
    assert gw.m("hybridgate:response_cache_hits_total{}") == hits + 1  # only the repeat of the base request
    assert gw.m("hybridgate:response_cache_misses_total{}") == misses + len(variants)  # sampled: not counted


def _concurrent(gw: Gateway, req, n: int, cancel_after: dict[int, int] | None = None, started=None):
    """n identical calls from n threads released together; call k is cancelled after cancel_after[k] messages."""
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(k: int) -> None:
        barrier.wait()
        call_ = gw.stub.Generate(req, timeout=60 * TIME_FACTOR)
        got = []
        try:
            for m in call_:
                got.append(m)
                if cancel_after and len(got) == cancel_after.get(k):
                    call_.cancel()
        except grpc.RpcError as exc:
            results[k] = (got, exc.code())
            return
        results[k] = (got, grpc.StatusCode.OK)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120 * TIME_FACTOR)
    return results


def test_ten_identical_concurrent_requests_cost_one_generation(stack):
    gw = stack["gateway"]
    tokens = 48
    before = gw.worker_work()
    alone = call(gw, request("Count to fifty.", max_tokens=tokens, ignore_eos=True, seed=5))  # the baseline
    one = [a - b for a, b in zip(gw.worker_work(), before)]
    coalesced, misses = gw.m("hybridgate:response_cache_coalesced_total{}"), gw.m("hybridgate:response_cache_misses_total{}")
    results = _concurrent(gw, request("Count to fifty.", max_tokens=tokens, ignore_eos=True), 10)
    ten = [a - b for a, b in zip(gw.worker_work(), before)]
    ten = [t - o for t, o in zip(ten, one)]
    assert all(code == grpc.StatusCode.OK for _, code in results)
    streams = [shape(got) for got, _ in results]
    assert all(s == streams[0] for s in streams) and sum(len(s[2]) for s in streams[0]) == tokens
    assert ten == one and one[0] == tokens == one[1], f"10 coalesced: {ten}; one alone: {one} (steps, seq-steps)"
    assert gw.m("hybridgate:response_cache_misses_total{}") == misses + 1
    assert gw.m("hybridgate:response_cache_coalesced_total{}") - coalesced == 9
    assert len(alone) > 1


def test_cancelling_leader_then_follower_leaves_the_rest_and_last_one_out_aborts(stack):
    gw = stack["gateway"]
    tokens = 64  # long enough that the followers join while it streams, even on a loaded machine
    req = request("Describe a forest.", max_tokens=tokens, ignore_eos=True)
    coalesced = gw.m("hybridgate:response_cache_coalesced_total{}")
    leader = gw.stub.Generate(req, timeout=60 * TIME_FACTOR)
    led = [next(leader)]  # the leader's generation is streaming before any follower arrives
    followers = [gw.stub.Generate(req, timeout=60 * TIME_FACTOR) for _ in range(9)]
    got = [[next(f)] for f in followers]  # each has joined the flight
    assert gw.m("hybridgate:response_cache_coalesced_total{}") - coalesced == 9
    leader.cancel()  # the leader leaves first ...
    with pytest.raises(grpc.RpcError) as info:
        led += list(leader)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    got[0] += [next(followers[0]) for _ in range(3)]
    followers[0].cancel()  # ... then a follower
    with pytest.raises(grpc.RpcError):
        list(followers[0])
    rest = [shape(g + list(f)) for g, f in zip(got[1:], followers[1:])]
    assert len(rest) == 8 and all(s == rest[0] for s in rest) and sum(len(p[2]) for p in rest[0]) == tokens
    assert shape(got[0]) == rest[0][:len(got[0])] and shape(led) == rest[0][:len(led)]

    before = gw.worker_work()
    long = request("Describe a desert.", max_tokens=2000, ignore_eos=True)
    left = _concurrent(gw, long, 2, cancel_after={0: 3, 1: 3})
    assert [code for _, code in left] == [grpc.StatusCode.CANCELLED] * 2
    steps = gw.worker_work()[0] - before[0]  # waits for num_requests_running == 0: the abort arrived
    assert steps < 200, f"the shared generation ran {steps} steps after all its clients left"
    assert call(gw, request("Describe a desert.", max_tokens=4))[-1].route != "cache"  # nothing half-stored


def test_redis_stopped_mid_test_serves_without_cache_and_recovers(stack):
    gw, redis = stack["gateway"], stack["redis"]
    redis.stop()
    answers = [call(gw, request("Name a fruit.", max_tokens=6)) for _ in range(3)]
    assert all(a[-1].finish_reason and a[-1].route != "cache" for a in answers)
    wait_metric(gw.metrics_url, "hybridgate:redis_up{}", lambda v: v == 0)
    assert gw.proc.text().count("response cache: Redis at") == 1  # logged once for the outage
    redis.start()
    wait_metric(gw.metrics_url, "hybridgate:redis_up{}", lambda v: v == 1)
    call(gw, request("Name a fruit.", max_tokens=6))  # Redis came back empty (no persistence): stored now
    assert call(gw, request("Name a fruit.", max_tokens=6))[-1].route == "cache"
    assert gw.proc.text().count("response cache: Redis at") == 2  # "... is back", once
