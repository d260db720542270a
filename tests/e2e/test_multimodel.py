"""Two models behind one `serve`: routed by name through both doors, listed, refused when unknown, each
with its own workers, hand-offs, health and chat template.

The models: the default SmolLM2 (`smol`: one CPU worker) and a tiny random-weight Llama GGUF with a real
llama.cpp vocabulary (`tiny`: one GPU worker, the torch runner on this CPU), so that each model has a
worker kind the other lacks: a hand-off that crossed models would find one.
References: SmolLM2's greedy ids are transformers' (tests/golden/greedy.json); the tiny model's are the
torch runner's own forward pass over a contiguous cache, in this process (the runner that
tests/component/test_architectures.py holds to transformers within 1e-3 on these files), from the prompt
ids the gateway's /tokenize reports for that model. Chat prompts: SmolLM2's own template (the file's) as
transformers renders and tokenizes it (tests/golden/chat.json), and the tiny model's per-model
`chat-template=FILE` as transformers' `render_jinja_template` renders it. One serve for the module; the
worker kill runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TIME_FACTOR, golden_json
from hf_reference import assert_greedy_matches, reference_greedy
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Serve, children_of, metrics, stub

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOL, TINY = "smol", "tiny"
TINY_ALIAS = "tiny-base"  # the tiny model's own --served-model-name (per model: served-model-name=...)
GREEDY = golden_json("greedy.json")["france"]
TINY_PROMPT = "The quick brown fox jumps over the lazy dog and"
STEPS = 12
# The tiny model's own chat template (a base model's plain "### Role:" turns), given per model only: SmolLM2
# keeps the ChatML template of its file.
TINY_TEMPLATE = ("{% for message in messages %}### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n\n"
                 "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_path(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path, tiny_path):
    folder = tmp_path_factory.mktemp("multimodel")
    template = folder / "tiny.jinja"
    template.write_text(TINY_TEMPLATE)
    proc = Serve(folder / "serve.log",
                 "--model", f"{SMOL}={model_path},gpu-workers=0,cpu-workers=1",
                 "--model", f"{TINY}={tiny_path},gpu-workers=1,cpu-workers=0,chat-template={template},"
                 f"served-model-name={TINY_ALIAS}",
                 "--allow-client-routes", "--no-measure-rates", "--worker-max-restarts", "0")
    yield proc
    assert proc.stop() == 0, proc.text()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.http_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120 * TIME_FACTOR) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(server, **fields) -> list[pb.GenerateResponse]:
    return list(stub(server.target).Generate(pb.GenerateRequest(temperature=0, **fields), timeout=120 * TIME_FACTOR))


def health(server, service: str) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def torch_greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The torch runner's greedy ids (fp32, CPU device, contiguous cache) and its top-2 gap per step."""
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.model import DecoderModel

    with torch.no_grad():
        return reference_greedy(DecoderModel(load_gguf(path), device=torch.device("cpu"), dtype=torch.float32),
                                prompt, steps)


def test_each_model_answers_its_own_reference_through_both_doors(server, tiny_path):
    france = pb.Chat(messages=[pb.ChatMessage(role="user", content=GREEDY["question"])])
    for named in ({"model": SMOL}, {}):  # named, and the default model when a request names none
        messages = generate(server, chat=france, max_tokens=32, **named)
        assert [t for m in messages for t in m.token_ids] == GREEDY["ids"], named
    status, body = post(server, "/v1/chat/completions", {"model": SMOL, "temperature": 0, "max_tokens": 32,
                        "messages": [{"role": "user", "content": GREEDY["question"]}]})
    assert status == 200 and body["model"] == SMOL, body
    assert body["choices"][0]["message"]["content"] == GREEDY["text"].removesuffix("<|im_end|>")

    status, tokenized = post(server, "/tokenize", {"model": TINY, "prompt": TINY_PROMPT})
    assert status == 200, tokenized
    _, smol_ids = post(server, "/tokenize", {"model": SMOL, "prompt": TINY_PROMPT})
    assert tokenized["tokens"] != smol_ids["tokens"]  # each model's own vocabulary
    want, gaps = torch_greedy(tiny_path, tokenized["tokens"], STEPS)
    messages = generate(server, prompt=TINY_PROMPT, model=TINY, max_tokens=STEPS, ignore_eos=True)
    assert messages[-1].usage.prompt_tokens == len(tokenized["tokens"])
    assert_greedy_matches([t for m in messages for t in m.token_ids], want, gaps)
    assert messages[-1].route.startswith("gpu (tiny-gpu-0)"), messages[-1].route
    status, body = post(server, "/v1/completions", {"model": TINY, "prompt": TINY_PROMPT, "temperature": 0,
                                                    "max_tokens": STEPS, "ignore_eos": True})
    assert status == 200 and body["model"] == TINY, body
    assert body["choices"][0]["text"] == "".join(m.text for m in messages)
    assert body["usage"]["completion_tokens"] == STEPS


def test_each_models_chat_renders_with_its_own_template_through_both_doors(server):
    """A per-model template reaches its model only: SmolLM2's chats stay ChatML (its file's template, as
    transformers renders and tokenizes it), the tiny model's follow its own file (transformers' rendering
    of that template), through /tokenize, /v1/chat/completions and gRPC Generate alike."""
    from transformers.utils.chat_template_utils import render_jinja_template

    case = golden_json("chat.json")["user_only"]
    messages = case["messages"]
    [tiny_text], _ = render_jinja_template([messages], chat_template=TINY_TEMPLATE, add_generation_prompt=True)
    for model, text in ((SMOL, case["text"]), (TINY, tiny_text)):
        status, tokenized = post(server, "/tokenize", {"model": model, "messages": messages})
        assert status == 200, tokenized
        ids = tokenized["tokens"]
        if model == SMOL:
            assert ids == case["ids"]  # transformers' apply_chat_template(tokenize=True)
        status, decoded = post(server, "/detokenize", {"model": model, "tokens": ids})
        assert status == 200 and decoded["prompt"] == text, (model, decoded)
        # The same ids as a token-id prompt: both doors' chats must have rendered exactly these.
        status, plain = post(server, "/v1/completions", {"model": model, "prompt": ids, "temperature": 0,
                                                         "max_tokens": 4, "ignore_eos": True,
                                                         "skip_special_tokens": False})
        assert status == 200, plain
        status, chat = post(server, "/v1/chat/completions", {"model": model, "messages": messages,
                                                             "temperature": 0, "max_tokens": 4, "ignore_eos": True,
                                                             "skip_special_tokens": False})
        assert status == 200 and chat["usage"]["prompt_tokens"] == len(ids), chat
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"], (model, chat, plain)
        grpc_chat = pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
        streamed = generate(server, chat=grpc_chat, model=model, max_tokens=4, ignore_eos=True,
                            skip_special_tokens=False)
        assert streamed[-1].usage.prompt_tokens == len(ids)
        assert "".join(m.text for m in streamed) == plain["choices"][0]["text"], model


def test_every_model_is_listed_and_an_unknown_one_is_not_found(server):
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=10) as resp:
        listed = json.loads(resp.read())
    # Each name and each alias its own entry; the alias is the tiny model's own (per model), smol has none.
    assert [(m["id"], m["root"]) for m in listed["data"]] == [(SMOL, SMOL), (TINY, TINY), (TINY_ALIAS, TINY)]
    info = stub(server.target).GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == SMOL and [m.model_id for m in info.models] == [SMOL, TINY]
    assert [list(m.aliases) for m in info.models] == [[], [TINY_ALIAS]]  # no general.name in a fleet
    assert stub(server.target).GetModelInfo(pb.GetModelInfoRequest(model=TINY_ALIAS)).model_id == TINY
    tiny = stub(server.target).GetModelInfo(pb.GetModelInfoRequest(model=TINY))
    assert tiny.model_id == TINY and [w.kind for w in tiny.workers] == ["gpu"]
    assert tiny.fingerprint != info.fingerprint and [w.kind for w in info.workers] == ["cpu"]

    status, body = post(server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert SMOL in body["error"]["message"] and TINY in body["error"]["message"]
    for call in (lambda: generate(server, prompt="hi", model="nope", max_tokens=1),
                 lambda: stub(server.target).GetModelInfo(pb.GetModelInfoRequest(model="nope"))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert SMOL in err.value.details() and TINY in err.value.details()
    # The command line's doors to the same: a model's health, and a request that names a model.
    out = subprocess.run([HYBRIDGATE, "health", "--target", server.target, "--service", TINY], capture_output=True,
                         text=True, timeout=60 * TIME_FACTOR)
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([HYBRIDGATE, "generate", "--target", server.target, "--model", "nope", "hi"],
                         capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert out.returncode != 0 and "NOT_FOUND" in out.stderr, out.stdout + out.stderr


def test_each_workers_log_lines_name_its_model(server):
    # The workers share serve's stderr: each one's lines carry its name and its served model's.
    text = server.text()
    for name, kind, model in ((f"{SMOL}-cpu-0", "cpu", SMOL), (f"{TINY}-gpu-0", "gpu", TINY)):
        assert re.search(rf"worker {name} \({model}\) INFO {kind} worker ready on ipc://", text), text
    unnamed = [line for line in text.splitlines() if re.search(r" worker (INFO|WARNING|ERROR) ", line)]
    assert not unnamed, unnamed


def test_a_handoff_never_crosses_models(server):
    """gpu->cpu for either model: its own pool lacks one of the kinds, the other model's pool has it; the
    request runs within its model (or is UNAVAILABLE), never on the other model's worker."""
    for model, other in ((TINY, SMOL), (SMOL, TINY)):
        try:
            messages = generate(server, prompt="Once upon a time", model=model, max_tokens=4, ignore_eos=True,
                                route="gpu->cpu")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and other not in exc.details(), exc.details()
        else:
            route = messages[-1].route
            assert f"({model}-" in route and other not in route and "->" not in route.split("(")[0], route


def test_metrics_are_labelled_by_model_and_count_http_streams(server):
    """The per-request series carry model_name (only tiny's move for a tiny request), and the ITL
    histogram counts a stream of the HTTP door (before, only gRPC streams were)."""
    before = metrics(server.metrics_url)
    for _ in range(2):
        status, _ = post(server, "/v1/completions", {"model": TINY, "prompt": TINY_PROMPT, "temperature": 0,
                                                     "max_tokens": STEPS, "ignore_eos": True})
        assert status == 200
    after = metrics(server.metrics_url)

    def grew(series: str, model: str, extra: str = "") -> float:
        key = f"hybridgate:{series}{{{extra}model_name={model}}}"
        return after.get(key, 0) - before.get(key, 0)

    assert grew("request_success_total", TINY, "finished_reason=length,") == 2
    assert grew("time_to_first_token_seconds_count", TINY) == 2
    assert 2 <= grew("inter_token_latency_seconds_count", TINY) <= 2 * (STEPS - 1)
    assert grew("time_to_first_token_seconds_count", SMOL) == grew("inter_token_latency_seconds_count", SMOL) == 0
    for model in (SMOL, TINY):
        assert after[f"vllm:inter_token_latency_seconds_count{{model_name={model}}}"] == \
            after[f"hybridgate:inter_token_latency_seconds_count{{model_name={model}}}"]
        assert f"vllm:num_requests_running{{model_name={model}}}" in after


def worker_of(server, model: str) -> int:
    """The child of serve bound to `model`'s only worker endpoint (ipc: the socket file's inode, from
    /proc/net/unix, among the child's open descriptors)."""
    [worker] = stub(server.target).GetModelInfo(pb.GetModelInfoRequest(model=model)).workers
    path = worker.endpoint.removeprefix("ipc://")
    inodes = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
              if line.split()[-1] == path}
    for pid in children_of(server.pid):
        try:
            links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            return pid
    raise AssertionError(f"no child of serve is bound to {worker.endpoint}")


def test_one_models_pool_going_down_leaves_the_other_serving(server):
    serving, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert [health(server, s) for s in ("", SMOL, TINY)] == [serving] * 3
    os.kill(worker_of(server, TINY), signal.SIGKILL)  # --worker-max-restarts 0: it stays down
    deadline = time.monotonic() + 10 * TIME_FACTOR
    while health(server, TINY) != down:
        assert time.monotonic() < deadline, "tiny's health still SERVING with its only worker killed"
        time.sleep(0.05)
    assert health(server, SMOL) == serving and health(server, "") == serving
    assert health(server, "hybridgate.v1.Generation") == serving
    messages = generate(server, prompt="Once upon a time", model=SMOL, max_tokens=4, ignore_eos=True)
    assert sum(len(m.token_ids) for m in messages) == 4
    with pytest.raises(grpc.RpcError) as err:
        generate(server, prompt=TINY_PROMPT, model=TINY, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with urllib.request.urlopen(server.http_url.removesuffix("/v1") + "/health", timeout=10) as resp:
        assert resp.status == 200  # the gateway as a whole still serves
