"""The HTTP door's edges, on the ASGI app itself (no server, no worker): the bearer token in front of every
route, the 4 MiB body limit before FastAPI reads a body, admission per choice, the label's limit, and
/tokenize and /detokenize through generation's prompt path and limits (the long-prompt pool included)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from hybridgate.gateway.admission import Admission
from hybridgate.gateway.http import OpenAIApp
from hybridgate.gateway.http_guard import MAX_BODY_BYTES
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.router import Router, RouterConfig
from hybridgate.router.prompts import INLINE_CHARS
from hybridgate.router.prompts import MAX_PROMPT_BYTES
from hybridgate.router.deltas import Delta
from hybridgate.wire import FinishReason, InvalidFieldError

TOKEN = "edge-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}ANSWER:{% endif %}"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def door(tmp_path_factory, gguf_model):
    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(TEMPLATE)
    router = Router(gguf_model, [], RouterConfig(chat_template=str(template), prompt_processes=1))
    yield OpenAIApp(router, GatewayMetrics(), Admission(2), ("m",), auth_token=TOKEN)
    router.prompts.close()


def call(app, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
         chunk: int | None = None) -> tuple[int, dict, dict]:
    """One request straight to the ASGI app: (status, headers, JSON body). `chunk`: send the body in
    pieces of that size without a Content-Length (as a chunked upload). Fails if the app reads a body
    it was given a Content-Length over the limit for."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    hdrs = [(k.encode(), v.encode()) for k, v in {"content-type": "application/json", **(headers or {})}.items()]
    if chunk is None:
        hdrs.append((b"content-length", str(len(raw)).encode()))
        pieces = [raw]
    else:
        pieces = [raw[i:i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": hdrs, "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234), "root_path": ""}
    read = {"n": 0}
    sent: list[dict] = []

    async def receive() -> dict:
        if chunk is None and len(raw) > MAX_BODY_BYTES:
            raise AssertionError("the body was read although its Content-Length is over the limit")
        if read["n"] < len(pieces):
            read["n"] += 1
            return {"type": "http.request", "body": pieces[read["n"] - 1], "more_body": read["n"] < len(pieces)}
        await asyncio.sleep(3600)  # the client stays; a disconnect watcher waits

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 120))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, (json.loads(data) if headers.get("content-type") == "application/json" else {})


@pytest.mark.parametrize("path", ["/openapi.json", "/v1/models", "/metrics", "/no-such-route"])
def test_every_route_but_health_wants_the_token(door, path):
    status, headers, body = call(door.app, "GET", path)
    assert status == 401 and headers["www-authenticate"] == "Bearer", (path, status)
    assert body["error"]["code"] == "invalid_api_key"
    assert call(door.app, "GET", path, headers={"authorization": "Bearer wrong"})[0] == 401
    assert call(door.app, "GET", path, headers=AUTH)[0] == (404 if path == "/no-such-route" else 200)
    assert call(door.app, "GET", "/health")[0] == 503  # open, and no worker is READY here


def test_one_model_is_retrieved_by_its_name_and_an_unknown_one_is_404(door):
    status, _, listed = call(door.app, "GET", "/v1/models", headers=AUTH)
    name = listed["data"][0]["id"]
    status, _, card = call(door.app, "GET", f"/v1/models/{name}", headers=AUTH)
    assert status == 200 and card == listed["data"][0]
    status, _, body = call(door.app, "GET", "/v1/models/no-such-model", headers=AUTH)
    assert status == 404 and body["error"]["code"] == "model_not_found" and name in body["error"]["message"]


def test_the_404_of_an_unknown_model_lists_what_v1_models_lists(door):
    """Without --served-model-name the model also answers to its file's general.name, an alias that
    /v1/models hides (ServedModel.list_aliases); the 404 named it among the served models all the same."""
    from hybridgate.models import model_names

    stem, alias = model_names(door.router.model)  # the default model's file has a general.name of its own
    implicit = OpenAIApp(door.router, GatewayMetrics(), Admission(2))
    status, _, listed = call(implicit.app, "GET", "/v1/models")
    assert status == 200 and [card["id"] for card in listed["data"]] == [stem]
    for path, method, body in (("/v1/models/no-such-model", "GET", None),
                               ("/v1/completions", "POST", {"model": "no-such-model", "prompt": "hi"})):
        status, _, got = call(implicit.app, method, path, body)
        assert status == 404 and got["error"]["param"] == "model", got
        assert got["error"]["message"].endswith(f"this server serves {stem}") and alias not in got["error"]["message"]
    assert call(implicit.app, "GET", f"/v1/models/{alias}")[0] == 200  # still answered to


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_post_body_sent_as_another_type_than_json_is_415_naming_content_type(door, path):
    """curl -d sends a form's Content-Type: FastAPI then validated the body as bytes ("Input should be a
    valid dictionary", no param), also one without a Content-Type; a JSON type with parameters is JSON."""
    body = {"model": "m", "messages": CHAT, "prompt": "hello", "input": "hello", "max_tokens": 1}
    for given, said in (("application/x-www-form-urlencoded", "got Content-Type 'application/x-www-form-urlencoded'"),
                        ("text/plain", "got Content-Type 'text/plain'"), ("", "got no Content-Type")):
        status, _, got = call(door.app, "POST", path, body, {**AUTH, "content-type": given})
        assert status == 415 and got["error"]["param"] == "Content-Type", got
        assert "`Content-Type: application/json`" in got["error"]["message"] and said in got["error"]["message"]
        assert got["error"]["code"] == "unsupported_media_type"
    for given in ("application/json; charset=utf-8", "application/vnd.api+json"):
        status, _, got = call(door.app, "POST", "/tokenize", {"model": "m", "prompt": "hello"},
                              {**AUTH, "content-type": given})
        assert status == 200 and got["tokens"] == door.router.tokenizer.encode("hello"), (given, got)


def test_a_misspelt_field_is_logged_as_ignored_naming_it_and_the_nearest_field(door, monkeypatch, caplog):
    """A request with `max_token` runs to the default length with no error: the log is where its sender
    finds out, so the line names the field, says it was ignored, and names the field meant."""
    from hybridgate.gateway import openai_api as api

    monkeypatch.setattr(api, "unknown_fields", api._Unknown())  # a fresh "logged once" memory
    for body in ({"model": "m", "prompt": "hi", "max_token": 3}, {"model": "m", "prompt": "hi", "max_token": 4},
                 {"model": "m", "prompt": "hi", "made_up_field": 1}):
        with caplog.at_level("WARNING", logger="hybridgate.gateway"):
            call(door.app, "POST", "/v1/completions", body, AUTH)  # 503 here: no worker is READY
    lines = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert lines == ["ignoring the request field 'max_token': it is not part of the OpenAI API this gateway "
                     "serves; did you mean 'max_tokens'? (logged once)",
                     "ignoring the request field 'made_up_field': it is not part of the OpenAI API this gateway "
                     "serves (logged once)"]


def test_a_body_over_4_mib_is_413_before_it_is_read(door):
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    status, headers, body = call(door.app, "POST", "/v1/chat/completions", big, AUTH)
    assert status == 413 and body["error"]["type"] == "invalid_request_error", body
    assert str(MAX_BODY_BYTES) in body["error"]["message"]
    status, _, body = call(door.app, "POST", "/v1/chat/completions", big, AUTH, chunk=1 << 16)  # no Content-Length
    assert status == 413, body
    small = {"model": "m", "prompt": "hello"}  # a chunked body under the limit is served
    assert call(door.app, "POST", "/tokenize", small, AUTH, chunk=3)[2]["tokens"] == \
        door.router.tokenizer.encode("hello")


def test_admission_counts_each_choice(door):
    """Two slots: a request for three choices is refused at once (429), not taken as one slot."""
    status, headers, body = call(door.app, "POST", "/v1/chat/completions",
                                 {"model": "m", "messages": CHAT, "n": 3, "max_tokens": 2}, AUTH)
    assert status == 429 and "retry-after" in headers, body
    assert "--max-inflight-requests" in body["error"]["message"]
    assert door.admission.inflight == 0


def test_the_label_is_at_most_256_bytes(door):
    status, _, body = call(door.app, "POST", "/v1/chat/completions",
                           {"model": "m", "messages": CHAT, "user": "é" * 129, "max_tokens": 2}, AUTH)
    assert status == 400 and body["error"]["param"] == "user" and "256" in body["error"]["message"], body
    with pytest.raises(InvalidFieldError, match="256 bytes") as e:  # the gRPC door's INVALID_ARGUMENT
        door.router.generate("hello", label="x" * 257)
    assert e.value.field == "label"
    door.router.generate("hello", label="x" * 256)


def test_tokenize_takes_generations_limits(door):
    status, _, body = call(door.app, "POST", "/tokenize", {"model": "m", "prompt": "a" * (MAX_PROMPT_BYTES + 1)}, AUTH)
    assert status == 400 and body["error"]["param"] == "prompt" and str(MAX_PROMPT_BYTES) in body["error"]["message"]
    limit = door.router.max_model_len
    status, _, body = call(door.app, "POST", "/detokenize", {"model": "m", "tokens": [0] * (limit + 1)}, AUTH)
    assert status == 400 and body["error"]["param"] == "tokens" and str(limit) in body["error"]["message"], body


def test_a_long_chat_is_rendered_with_the_chat_template_file(door, tokenizer):
    """Over INLINE_CHARS the chat goes to the pool, which must render with --chat-template too."""
    content = "Paris is lovely. " * (INLINE_CHARS // 16)
    for generation_prompt, tail in ((True, "ANSWER:"), (False, "")):
        status, _, body = call(door.app, "POST", "/tokenize", {"model": "m", "add_generation_prompt": generation_prompt,
                                                               "messages": [{"role": "user", "content": content}]}, AUTH)
        assert status == 200, body
        assert body["tokens"] == tokenizer.encode(f"<user>{content}\n{tail}")
    ids = asyncio.run(door.router.prompts.encode([{"role": "user", "content": content}]))  # generation's path
    assert list(ids) == tokenizer.encode(f"<user>{content}\nANSWER:")


def test_the_prompt_pool_is_started_afresh_after_a_process_dies(door, tokenizer):
    """A killed pool process used to break every later long prompt (BrokenProcessPool) until restart."""
    prompts = door.router.prompts.encoder  # the pool behind the router's Prompts
    text = "Lyon and Marseille. " * (INLINE_CHARS // 16)
    expected = tokenizer.encode(text)
    assert list(asyncio.run(prompts.encode(text))) == expected
    for pid in list(prompts._pool._processes):
        os.kill(pid, signal.SIGKILL)
    for _ in range(2):  # the one that meets the broken pool, and the next
        assert list(asyncio.run(prompts.encode(text))) == expected
    assert prompts.restarts == 1
    status, _, body = call(door.app, "POST", "/tokenize", {"model": "m", "prompt": text}, AUTH)
    assert status == 200 and body["tokens"] == expected


def test_health_says_not_serving_after_stop_whatever_was_pending(gguf_model):
    """A ready change the router reported just before shutdown must not turn health back to SERVING."""
    from grpc_health.v1 import health_pb2

    from hybridgate.gateway.server import Gateway, GatewayConfig

    async def main():
        gateway = Gateway(Router(gguf_model, []), GatewayConfig(port=0, http_port=None))
        await gateway.start()
        gateway.on_ready_change(True)  # e.g. a worker became READY as SIGTERM came
        await gateway.stop()
        await asyncio.sleep(0.05)  # anything still scheduled runs now
        return gateway.health._server_status[""]

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.NOT_SERVING


class _Stream:
    """A stream of `n` one-token deltas, the last one finished."""

    request_id = "r"

    def __init__(self, n: int):
        self.n, self.read = n, 0
        self.prompt_ids, self.ids = [1, 2, 3], []  # as GenerationStream's: the prompt, the ids handed out

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> bool:
        return False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.read == self.n:
            raise StopAsyncIteration
        self.read += 1
        self.ids.append(7)
        finish = FinishReason.LENGTH if self.read == self.n else None
        return Delta(request_id="r", token_index=self.read - 1, text="x", token_ids=[7], finish_reason=finish)


def test_the_merged_queue_of_several_choices_is_bounded():
    """A client that reads slowly holds at most RUN_QUEUE_PER_CHOICE deltas a choice in the merged queue
    (it used to copy every delta of every choice there as they came)."""
    from types import SimpleNamespace

    from hybridgate.gateway.http_stream import RUN_QUEUE_PER_CHOICE, Run
    from hybridgate.gateway.openai_format import ChoiceState

    async def main():
        door = SimpleNamespace(metrics=GatewayMetrics(), log_requests=False)
        streams = [_Stream(500), _Stream(500)]
        run = Run(door, [ChoiceState(i, s) for i, s in enumerate(streams)],
                   SimpleNamespace(name="m", admission=Admission(4)))
        await run.enter()
        for _ in range(50):
            await asyncio.sleep(0)
        held = run._queue.qsize()
        got = [delta async for _, delta in run.deltas()]
        await run.close()
        return held, got

    held, got = asyncio.run(main())
    assert held <= 2 * RUN_QUEUE_PER_CHOICE
    assert len(got) == 1000 and sum(d.finish_reason is not None for d in got) == 2


def test_continuous_usage_gives_every_chunk_its_count_of_ids(door):
    """vLLM's stream_options.continuous_usage_stats: a client times the ids themselves (bench serve's
    --compare-protocols does), also those of a delta with no text yet."""
    from types import SimpleNamespace

    from hybridgate.gateway.openai_format import ChoiceState

    state = ChoiceState(0, SimpleNamespace(prompt_ids=[1, 2, 3]))
    chunks = door.format.chunks("text", [state], include_usage=True, continuous_usage=True)
    got = []
    for delta in (Delta("r", 0, "", [5, 6]), Delta("r", 2, "Paris", [7], FinishReason.LENGTH)):
        state.add(delta)
        got += [json.loads(c.removeprefix(b"data: ")) for c in chunks.delta(state, delta)]
    assert [c["usage"] for c in got] == [{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                                         {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}]
    plain = door.format.chunks("text", [state], include_usage=True)
    assert json.loads(plain.delta(state, Delta("r", 2, "Paris", [7]))[0].removeprefix(b"data: "))["usage"] is None
    assert plain.delta(state, Delta("r", 0, "", [5, 6])) == []


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_is_the_openai_chunk_of_that_text(door, kind, include_usage):
    """The chunk of a choice's text alone (made from bytes kept per choice, the hot path) is the OpenAI
    chunk object: every field, in the order the other chunks have, the text escaped as JSON."""
    from types import SimpleNamespace

    from hybridgate.gateway.openai_format import ChoiceState

    states = [ChoiceState(i, SimpleNamespace(prompt_ids=[1, 2])) for i in range(2)]
    chunks = door.format.chunks(kind, states, include_usage=include_usage)
    texts = ["Paris", ' "quoted" \\ back', "\n\t\x01 control", "é€😀 中文", "</script>\u2028"]
    for k, text in enumerate(texts):
        state = states[k % 2]
        (raw,) = chunks.delta(state, Delta("r", k, text, [7]))
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
        got = json.loads(raw.removeprefix(b"data: "))
        body = {"content": text} if kind == "chat" else None
        choice = {"index": state.index, "delta": body} if kind == "chat" else {"index": state.index, "text": text}
        choice.update(logprobs=None, finish_reason=None)
        want = {"id": chunks.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": got["created"], "model": "m", "system_fingerprint": "fp_" + door.router.fingerprint[:12],
                "choices": [choice]}
        if include_usage:
            want["usage"] = None
        assert list(got.items()) == list(want.items())
        assert abs(got["created"] - time.time()) < 5
