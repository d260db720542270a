"""End to end: `serve` on a base model (a tiny Llama GGUF without chat template or general.name) names it
by its file and serves completions; a chat is refused on both doors naming --chat-template (issue 26)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import gguf
import grpc
import pytest
from tiny_gguf import write_tiny_llama

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import Serve, metrics, stub

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    model = write_tiny_llama(folder / "tiny-base-v1.gguf", heads=4, kv_heads=2)
    assert "general.name" not in gguf.GGUFReader(model).fields and \
        "tokenizer.chat_template" not in gguf.GGUFReader(model).fields
    proc = Serve(folder / "serve.log", "--model", str(model), "--gpu-workers", "1", "--cpu-workers", "0")
    yield proc
    assert proc.stop() == 0, proc.text()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60 * TIME_FACTOR) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_model_is_named_by_its_file_stem(server):
    info = stub(server.target).GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == "tiny-base-v1"
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=30 * TIME_FACTOR) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-base-v1"]
    assert metrics(server.metrics_url)[
        f"hybridgate:model_info{{fingerprint={info.fingerprint},model_name=tiny-base-v1}}"] == 1


def test_completions_are_served(server):
    messages = list(stub(server.target).Generate(pb.GenerateRequest(prompt="abc", max_tokens=5, ignore_eos=True)))
    assert sum(len(m.token_ids) for m in messages) == 5 and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    status, body = post(server, "/v1/completions", {"model": "tiny-base-v1", "prompt": "abc", "max_tokens": 3,
                                                    "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


def test_a_chat_is_refused_on_both_doors_naming_the_flag(server):
    status, body = post(server, "/v1/chat/completions", {"model": "tiny-base-v1", "messages": CHAT, "max_tokens": 3})
    assert status == 400 and "--chat-template" in body["error"]["message"], body
    with pytest.raises(grpc.RpcError) as refused:
        list(stub(server.target).Generate(pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT]), max_tokens=3)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("messages: ") and "--chat-template" in refused.value.details()
