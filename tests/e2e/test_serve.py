"""End to end: `hybridgate serve` in a subprocess, clients over real gRPC."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import gguf
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TIME_FACTOR, golden_json
from hybridgate.models import default_model_path
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Proc, Serve, metrics, stub, wait_metric

GREEDY = golden_json("greedy.json")
FRANCE = "What is the capital of France?"
AFTER_ABORT = "hybridgate:engine_tokens_after_abort_total{}"
# The served name: the default model's file name without .gguf (its general.name is an alias).
NAME = f"model_name={default_model_path().name.removesuffix('.gguf')}"
ABORTED = f"hybridgate:request_success_total{{finished_reason=abort,{NAME}}}"
KV_BYTES = "hybridgate:kv_cache_bytes{}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    # The torch runner alone (fp32 on a CPU device here): its greedy ids are the fp32 reference's.
    proc = Serve(tmp_path_factory.mktemp("serve") / "serve.log", "--cpu-workers", "0", "--gpu-workers", "1",
                 "--log-requests")
    yield proc
    assert proc.stop() == 0, proc.text()


def run_cli(server, *args, input=None) -> subprocess.CompletedProcess:
    return subprocess.run([HYBRIDGATE, "generate", "--target", server.target, *args], capture_output=True,
                          text=True, input=input, timeout=120 * TIME_FACTOR)


def test_cli_streams_the_reference_answer(server):
    out = run_cli(server, "--chat", "--max-tokens", "32", "--temperature", "0", "--json", FRANCE)
    assert out.returncode == 0, out.stderr
    *messages, trailer = [json.loads(line) for line in out.stdout.splitlines()]
    assert [t for m in messages for t in m["token_ids"]] == GREEDY["france"]["ids"]
    assert trailer["trailing_metadata"]["hybridgate-plan"] == "gpu"  # the placement, last
    assert messages[-1]["finish_reason"] == "FINISH_REASON_EOS"
    assert [("finish_reason" in m) for m in messages] == [False] * (len(messages) - 1) + [True]
    # stdin as `echo` pipes it: the trailing newline is not part of the prompt
    plain = run_cli(server, "--chat", "--max-tokens", "32", "--temperature", "0", "-", input=FRANCE + "\n")
    assert plain.stdout.strip() == "The capital of France is Paris." and "finish_reason=eos" in plain.stderr


def test_special_tokens_stay_out_of_the_text_unless_asked(server, tokenizer):
    # Greedy past EOS: the answer ends with <|im_end|> (id 2) and generation goes on to 16 tokens.
    args = ("--chat", "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--json", FRANCE)
    for extra, kept in (((), False), (("--no-skip-special-tokens",), True)):
        out = run_cli(server, *extra, *args)
        assert out.returncode == 0, out.stderr
        *messages, _ = [json.loads(line) for line in out.stdout.splitlines()]  # the last: trailing metadata
        ids, text = [t for m in messages for t in m["token_ids"]], "".join(m.get("text", "") for m in messages)
        assert len(ids) == 16 and ids[:8] == GREEDY["france"]["ids"]
        assert tokenizer.eos_token_id == 2 and 2 in ids
        assert ("<|im_end|>" in text) == kept and text == tokenizer.decode(ids, skip_special_tokens=not kept)


def test_request_log_line(server):
    label = "log-line-check"
    messages = list(stub(server.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE)]), max_tokens=32, temperature=0,
        label=label)))
    line = server.wait_for(rf"request id=\S+ label='{label}'.*\n").group(0)
    assert f"id={messages[0].request_id} " in line
    expected = (f"route=gpu (gpu-0) prompt_tokens={len(GREEDY['france']['prompt_ids'])} completion_tokens=8 ttft_ms=",
                "finish_reason=eos status=OK")
    assert all(e in line for e in expected), line
    ttft, total = (float(re.search(rf"{k}=([\d.]+)", line).group(1)) for k in ("ttft_ms", "total_ms"))
    assert 0 < ttft <= total
    assert "France" not in line  # no prompt text unless --log-request-text


def test_cli_names_a_flag_the_proto_cannot_hold(server):
    out = run_cli(server, "--max-tokens", "-3", "hi")
    assert out.returncode != 0 and "--max-tokens" in out.stderr and "Traceback" not in out.stderr


def test_tokens_stream_as_they_are_made(server):
    start = time.monotonic()
    arrivals = [time.monotonic() - start for _ in stub(server.target).Generate(
        pb.GenerateRequest(prompt="Once upon a time", max_tokens=128, ignore_eos=True, temperature=0))]
    assert len(arrivals) >= 64
    assert arrivals[0] < arrivals[-1] / 4


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"chat": pb.Chat()}, "messages"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.01}, "top_p"),
        ({"prompt": "hi", "top_p": float("nan")}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"prompt": "hi", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "hi", "stop": ["s" * 257]}, "stop"),
        ({"prompt": "hi", "max_tokens": 8192}, "max_tokens"),
        ({"chat": pb.Chat(messages=[pb.ChatMessage(role="wizard", content="hi")])}, "role"),
        ({"chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="  ")])}, "messages"),
        ({"chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * ((1 << 20) + 1))])}, "content"),
    ],
)
def test_bad_fields_are_invalid_argument(server, fields, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server.target).Generate(pb.GenerateRequest(**fields)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    ok = list(stub(server.target).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, ignore_eos=True)))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("route", ["gpu", "cpu", "gpu->cpu", "tpu"])
def test_a_route_needs_the_operators_flag(server, route):
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server.target).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, route=route)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("route: ") and "--allow-client-routes" in info.value.details()
    ok = list(stub(server.target).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, ignore_eos=True, route="auto")))
    assert ok[-1].route.startswith("gpu (")
    names = set(metrics(server.metrics_url))
    assert "hybridgate:kv_handoff_total{direction=gpu_to_cpu,outcome=done}" in names
    assert "hybridgate:kv_handoff_seconds_count{direction=gpu_to_cpu}" in names


def test_size_limits(server, tokenizer):
    client = stub(server.target)
    with pytest.raises(grpc.RpcError) as info:
        list(client.Generate(pb.GenerateRequest(prompt="x" * (2 << 20))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in info.value.details() and "1 MiB" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(client.Generate(pb.GenerateRequest(prompt="x" * 5_000_000)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        list(client.Generate(pb.GenerateRequest(prompt="hello " * 9000)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    n = len(tokenizer.encode("hello " * 9000))
    assert f"prompt: {n} tokens" in info.value.details() and "8192" in info.value.details()


def test_health_reflection_and_model_info(server, model_path):
    channel = grpc.insecure_channel(server.target)
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="hybridgate.v1.Generation"))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    info = stub(server.target).GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_model_len == 8192 and len(info.fingerprint) == 64
    # No --served-model-name: the file's name without .gguf, and its general.name (gguf's reader) as an alias.
    alias = gguf.GGUFReader(model_path).fields["general.name"].contents()
    assert info.model_id == model_path.name.removesuffix(".gguf") and list(info.aliases) == [alias]
    assert [(m.model_id, list(m.aliases)) for m in info.models] == [(info.model_id, [alias])]
    # /v1/models lists the model once: the file's alias (with spaces) is not a second model in a picker
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=30 * TIME_FACTOR) as r:
        assert [(m["id"], m["root"]) for m in json.loads(r.read())["data"]] == [(info.model_id, info.model_id)]
    with urllib.request.urlopen(server.http_url + "/v1/models/" + urllib.parse.quote(alias),
                                timeout=30 * TIME_FACTOR) as r:  # yet a request may name it
        card = json.loads(r.read())
        assert (card["id"], card["root"]) == (alias, info.model_id)
    named = stub(server.target).GetModelInfo(pb.GetModelInfoRequest(model=alias))  # the alias picks the model
    assert named.model_id == info.model_id and named.fingerprint == info.fingerprint
    assert [(w.kind, w.ready) for w in info.workers] == [("gpu", True)]
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "hybridgate.v1.Generation" in [s.name for s in reply.list_services_response.service]


def test_metrics_count_what_one_request_did(server, model_path):
    """One request of known size (a prompt whose ids the reference tokenizer gave, 4 tokens out):
    each counter moves by what that request did, and model_info names the model as its file does."""
    golden = golden_json("tokenizer.json")
    text, ids = max(((t, i) for t, i in zip(golden["strings"], golden["ids"]) if len(i) <= 64), key=lambda c: len(c[1]))
    url, out = server.metrics_url, 4
    wait_metric(url, "hybridgate:num_requests_running{}", lambda v: v == 0)
    before = metrics(url)
    messages = list(stub(server.target).Generate(pb.GenerateRequest(prompt=text, max_tokens=out, ignore_eos=True,
                                                                    temperature=0)))
    assert messages[-1].usage.prompt_tokens == len(ids) and messages[-1].usage.completion_tokens == out
    wait_metric(url, KV_BYTES, lambda v: v == 0)
    grew = {name: lambda v, name=name, n=n: v - before.get(name, 0) == n for name, n in {
        f"hybridgate:time_to_first_token_seconds_count{{{NAME}}}": 1,
        f"hybridgate:e2e_request_latency_seconds_count{{{NAME}}}": 1,
        f"hybridgate:request_success_total{{finished_reason=length,{NAME}}}": 1,
        "hybridgate:engine_prefill_tokens_total{}": len(ids),  # a prompt no earlier test sent: no cache hit
        "hybridgate:engine_steps_total{}": out,  # one prefill step, then one decode step per further token
        "hybridgate:engine_batch_size_count{}": out}.items()}
    for name, check in grew.items():
        wait_metric(url, name, check)
    after = metrics(url)
    assert after[AFTER_ABORT] == before[AFTER_ABORT]
    ttft, e2e = f"hybridgate:time_to_first_token_seconds_sum{{{NAME}}}", f"hybridgate:e2e_request_latency_seconds_sum{{{NAME}}}"
    assert 0 < after[ttft] - before[ttft] <= after[e2e] - before[e2e]
    name = model_path.name.removesuffix(".gguf")
    info = stub(server.target).GetModelInfo(pb.GetModelInfoRequest())
    assert after[f"hybridgate:model_info{{fingerprint={info.fingerprint},model_name={name}}}"] == 1
    # The same observations under vLLM's names, labelled by the served model's name.
    vllm = f"model_name={name}"
    assert after[f"vllm:time_to_first_token_seconds_count{{{vllm}}}"] - before[f"vllm:time_to_first_token_seconds_count{{{vllm}}}"] == 1
    for series in ("time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum", "inter_token_latency_seconds_count"):
        assert after[f"vllm:{series}{{{vllm}}}"] == after[f"hybridgate:{series}{{{vllm}}}"]
    assert after[f"vllm:request_success_total{{finished_reason=length,{vllm}}}"] == \
        after[f"hybridgate:request_success_total{{finished_reason=length,{vllm}}}"]
    assert after[f"vllm:num_requests_running{{{vllm}}}"] == 0 and after[f"vllm:kv_cache_usage_perc{{{vllm}}}"] == 0
    config = next(k for k in after if k.startswith("vllm:cache_config_info{"))
    assert "block_size=16," in config and after[config] == 1


def long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Once upon a time", max_tokens=2000, ignore_eos=True)


def assert_aborted_cleanly(server, before: float) -> None:
    wait_metric(server.metrics_url, KV_BYTES, lambda v: v == 0)
    wait_metric(server.metrics_url, "hybridgate:num_requests_running{}", lambda v: v == 0)
    assert metrics(server.metrics_url)[AFTER_ABORT] - before <= 1


def test_client_cancel_after_three_messages(server):
    before = metrics(server.metrics_url)
    call = stub(server.target).Generate(long_request())
    for i, message in enumerate(call):
        if i == 2:
            call.cancel()
            break
    assert_aborted_cleanly(server, before[AFTER_ABORT])
    wait_metric(server.metrics_url, ABORTED, lambda v: v == before.get(ABORTED, 0) + 1)
    server.wait_for(rf"request id={message.request_id} .* finish_reason=abort status=CANCELLED", timeout=10)


def test_deadline_expiry(server):
    before = metrics(server.metrics_url)[AFTER_ABORT]
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server.target).Generate(long_request(), timeout=1.0 * TIME_FACTOR))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_aborted_cleanly(server, before)


def test_client_process_killed(server, tmp_path):
    before = metrics(server.metrics_url)[AFTER_ABORT]
    client = Proc(["generate", "--target", server.target, "--max-tokens", "2000", "--ignore-eos", "Once upon a time"],
                  tmp_path / "client.log")
    wait_metric(server.metrics_url, KV_BYTES, lambda v: v > 0)
    time.sleep(0.3)
    client.stop(signal.SIGKILL)
    assert_aborted_cleanly(server, before)


def test_eight_concurrent_requests_batch(server):
    def run(i, out):
        out[i] = list(stub(server.target).Generate(
            pb.GenerateRequest(prompt=f"Write about the number {i}.", max_tokens=48, ignore_eos=True, temperature=0)))

    before = metrics(server.metrics_url).get("hybridgate:engine_steps_by_batch_size_total{batch_size=8}", 0)
    results = {}
    threads = [threading.Thread(target=run, args=(i, results)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(sum(len(m.token_ids) for m in results[i]) == 48 for i in range(8))
    assert metrics(server.metrics_url)["hybridgate:engine_steps_by_batch_size_total{batch_size=8}"] > before


def test_a_second_serve_on_a_taken_port_fails_at_once(server):
    # gRPC's default SO_REUSEPORT would let both listen and split the requests between them.
    args = ["serve", "--port", str(server.port), "--cpu-workers", "0", "--gpu-workers", "1"]
    out = subprocess.run([HYBRIDGATE, *args], capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{server.port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("flag", "value"), [("--kv-cache-memory", "abc"), ("--threads", "0"),
                                             ("--max-num-seqs", "0"), ("--cpu-workers", "-1")])
def test_serve_flags_are_checked_before_anything_starts(flag, value):
    out = subprocess.run([HYBRIDGATE, "serve", flag, value], capture_output=True, text=True, timeout=30 * TIME_FACTOR)
    assert out.returncode == 2 and f"argument {flag}:" in out.stderr and "Traceback" not in out.stderr
