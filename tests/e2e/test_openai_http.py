"""End to end: the OpenAI-compatible HTTP API of `hybridgate serve`, through the real `openai` SDK and raw HTTP.

One serve for the module: the torch runner (fp32 on a CPU device here), whose greedy ids and logits are
the fp32 reference's (tests/golden, made by tests/reference/make_golden.py from transformers).
"""

from __future__ import annotations

import http.client
import json
import signal
import urllib.parse

import openai
import pytest

from conftest import TIME_FACTOR, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import Serve, metrics, stub, wait_metric

GREEDY = golden_json("greedy.json")["france"]
LOGPROBS = golden_json("logprobs.json")
FRANCE = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
CHAT = [{"role": "user", "content": FRANCE}]
MODEL = "hg-smollm"
INFLIGHT = 4
AFTER_ABORT = "hybridgate:engine_tokens_after_abort_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("openai") / "serve.log", "--cpu-workers", "0", "--gpu-workers", "1",
                 "--served-model-name", MODEL, "--served-model-name", "alias",
                 "--max-inflight-requests", str(INFLIGHT), "--grace-period", str(30 * TIME_FACTOR),
                 "--log-requests")
    yield proc
    assert proc.stop() == 0, proc.text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120 * TIME_FACTOR)


def post(server, path: str, body: bytes | dict, timeout: float = 120.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a raw POST."""
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=timeout * TIME_FACTOR)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def events(raw: bytes) -> list:
    """The SSE payloads of a whole stream, checking the framing: `data: ...` events separated by a blank line."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    frames = raw[:-2].split(b"\n\n")
    assert all(f.startswith(b"data: ") for f in frames), frames
    payloads = [f[len(b"data: "):] for f in frames]
    assert payloads[-1] == b"[DONE]" and b"[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def grpc_text(server, **fields) -> tuple[str, list[int]]:
    msgs = list(stub(server.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE)]), **fields)))
    return "".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids]


def test_chat_answers_paris_streamed_or_not_and_as_grpc_does(server, client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=32)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == ANSWER
    assert whole.choices[0].finish_reason == "stop"  # EOS is stop
    assert whole.usage.prompt_tokens == len(GREEDY["prompt_ids"]) and whole.usage.completion_tokens == len(GREEDY["ids"])
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0 and whole.system_fingerprint.startswith("fp_")
    streamed = client.chat.completions.create(model="alias", messages=CHAT, temperature=0, max_tokens=32, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content == grpc_text(server, max_tokens=32, temperature=0)[0]


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_shape_on_the_raw_bytes(server, include_usage):
    body = {"model": MODEL, "messages": CHAT, "temperature": 0.8, "seed": 5, "max_tokens": 12, "n": 2,
            "stream": True, "logprobs": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, headers, raw = post(server, "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    chunks = events(raw)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(("usage" in c) == include_usage for c in chunks)
    if include_usage:
        last, chunks = chunks[-1], chunks[:-1]
        assert last["choices"] == [] and all(c["usage"] is None for c in chunks)
        usage = last["usage"]
    streamed = 0
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        roles = [ch["delta"].get("role") for ch in mine]
        assert roles[0] == "assistant" and roles[1:] == [None] * (len(roles) - 1)
        finishes = [ch["finish_reason"] for ch in mine]
        assert finishes[-1] in ("stop", "length") and finishes[:-1] == [None] * (len(finishes) - 1)
        streamed += sum(len(ch["logprobs"]["content"]) for ch in mine if ch["logprobs"])  # one entry per token
    if include_usage:
        assert usage["completion_tokens"] == streamed and usage["prompt_tokens"] == len(GREEDY["prompt_ids"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + streamed


def test_stream_shape_through_the_sdk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(GREEDY["ids"])
    assert all(c.usage is None for c in chunks[:-1])
    deltas = [c.choices[0] for c in chunks[:-1]]
    assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]
    plain = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_n_choices_use_seed_plus_index(client):
    many = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=10, seed=1234, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=10,
                                              seed=1234 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so (at temperature 1) do the answers
    assert many.usage.prompt_tokens == len(GREEDY["prompt_ids"])  # counted once, as OpenAI counts it


def test_stop_strings_stop_ids_and_max_completion_tokens(client):
    def answer(**kw):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, **kw).choices[0]
        return r.message.content, r.finish_reason

    assert answer(stop=" Paris") == ("The capital of France is", "stop")
    assert answer(stop=["nowhere", " is"]) == ("The capital of France", "stop")
    # max_completion_tokens wins over max_tokens
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20, max_completion_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == \
        ("The capital of", "length", 3)
    # stop_token_ids (vLLM's extension): the 4th greedy id (" France") ends it, streamed and counted
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                       extra_body={"stop_token_ids": [GREEDY["ids"][3]]})
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == \
        ("The capital of France", "stop", 4)


def test_logprobs_equal_the_references_log_softmax(server, client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=32, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert [t.bytes for t in content] == [list(tokenizer.token_bytes[i]) for i in LOGPROBS["ids"]]
    for got, want, top_ids, top_lps in zip(content, LOGPROBS["logprobs"], LOGPROBS["top_ids"], LOGPROBS["top_logprobs"]):
        assert abs(got.logprob - want) < 1e-3
        assert len(got.top_logprobs) == 5
        values = [t.logprob for t in got.top_logprobs]
        assert values == sorted(values, reverse=True) and got.top_logprobs[0].bytes == got.bytes  # greedy: the top one
        assert max(abs(a - b) for a, b in zip(values, top_lps)) < 1e-3
        assert [t.bytes for t in got.top_logprobs] == [list(tokenizer.token_bytes[i]) for i in top_ids]
    # the gRPC door carries the same numbers (GenerateResponse.logprobs, one per token id)
    msgs = list(stub(server.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE)]), max_tokens=32, temperature=0, logprobs=3)))
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == sum(len(m.token_ids) for m in msgs) == len(LOGPROBS["ids"])
    assert all(abs(a.logprob - b) < 1e-3 and [t.token_id for t in a.top] == ids[:3]
               for a, b, ids in zip(lps, LOGPROBS["logprobs"], LOGPROBS["top_ids"]))
    # the completions form
    text = client.completions.create(model=MODEL, prompt=tokenizer.decode(LOGPROBS["prompt_ids"]), temperature=0,
                                     max_tokens=3, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(abs(a - b) < 1e-3 for a, b in zip(lp.token_logprobs, LOGPROBS["logprobs"]))
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)


def test_errors_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # a chat names its messages, the field it sent
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT,
                                       tools=[{"type": "function", "function": {"name": "f g", "parameters": {}}}])
    assert e.value.param == "tools[0].function.name"
    for field, value, param in (("logit_bias", {"50": 5}, "logit_bias"),
                                ("response_format", {"type": "xml"}, "response_format.type")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, **{field: value})
        assert e.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "hg-smollm", "messages": [', None),
    (b"not json at all", None),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": CHAT, "n": 17}, "n"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL}, "messages"),
])
def test_malformed_bodies_are_400_with_the_envelope(server, body, param):
    status, _, raw = post(server, "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in raw.decode()


def test_unknown_fields_are_ignored_and_logged_once(server, client):
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=2,
                                           extra_body={"made_up_field": 1})
        assert r.choices[0].message.content == "The capital"
    assert server.text().count("'made_up_field'") == 1


def test_the_user_field_is_the_request_label_in_the_log(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=2, user="user-label-7")
    line = server.wait_for(r"request id=\S+ label='user-label-7' door=http .*\n").group(0)
    assert f"prompt_tokens={len(GREEDY['prompt_ids'])} completion_tokens=2 " in line and "finish_reason=length" in line


def test_full_gateway_is_429_with_retry_after(server, client):
    conns = []
    try:
        for _ in range(INFLIGHT):  # hold every slot with a long stream, read past its first event
            conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=60 * TIME_FACTOR)
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once upon a time",
                         "max_tokens": 2000, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
            conns.append(conn)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        for conn in conns:
            conn.close()


def test_a_client_that_goes_away_aborts_its_request(server):
    wait_metric(server.metrics_url, "hybridgate:num_requests_running{}", lambda v: v == 0, timeout=30)
    before = metrics(server.metrics_url)
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=60 * TIME_FACTOR)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2000,
                 "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(4):  # the role event, then tokens
        assert resp.readline().startswith(b"data: ") and resp.readline() == b"\n"
    conn.close()
    wait_metric(server.metrics_url, "hybridgate:num_requests_running{}", lambda v: v == 0, timeout=30)
    wait_metric(server.metrics_url, "hybridgate:kv_cache_bytes{}", lambda v: v == 0, timeout=30)
    assert metrics(server.metrics_url)[AFTER_ABORT + "{}"] - before[AFTER_ABORT + "{}"] <= 1
    aborted = f"hybridgate:request_success_total{{finished_reason=abort,model_name={MODEL}}}"
    assert metrics(server.metrics_url).get(aborted, 0) > before.get(aborted, 0)


def test_a_client_that_goes_away_before_a_whole_answer_aborts_it(server):
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=60 * TIME_FACTOR)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once upon a time",
                 "max_tokens": 2000, "ignore_eos": True}), {"Content-Type": "application/json"})
    wait_metric(server.metrics_url, "hybridgate:num_requests_running{}", lambda v: v == 1, timeout=30)
    conn.close()
    wait_metric(server.metrics_url, "hybridgate:num_requests_running{}", lambda v: v == 0, timeout=30)
    wait_metric(server.metrics_url, "hybridgate:kv_cache_bytes{}", lambda v: v == 0, timeout=30)


def test_token_id_prompts_complete_as_their_text_does(server, client, tokenizer):
    """`prompt` as token ids (a list of ints, or a list of lists), as vLLM takes it: the same greedy completion
    and prompt tokens as the text those ids encode; an id outside the vocabulary is a 400 naming `prompt`."""
    text = "The capital of France is"
    ids = tokenizer.encode_prompt(text)
    kw = dict(model=MODEL, temperature=0, max_tokens=8)
    by_text = client.completions.create(prompt=text, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert (by_ids.choices[0].text, by_ids.usage.prompt_tokens) == (by_text.choices[0].text, len(ids))
    two = client.completions.create(prompt=[ids, ids[:-1]], **kw)
    assert two.choices[0].text == by_text.choices[0].text and len(two.choices) == 2
    assert two.usage.prompt_tokens == 2 * len(ids) - 1
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, tokenizer.vocab_size],
                                                       "max_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "prompt" and f"[0, {tokenizer.vocab_size})" in error["message"]


def test_models_health_metrics_openapi_tokenize(server):
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=30 * TIME_FACTOR)

    def get(path):
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()

    status, raw = get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL, "alias"]
    assert stub(server.target).GetModelInfo(pb.GetModelInfoRequest()).model_id == MODEL  # --served-model-name
    assert get("/health")[0] == 200
    status, raw = get("/metrics")
    assert status == 200 and b"hybridgate:time_to_first_token_seconds" in raw
    status, raw = get("/openapi.json")
    assert status == 200 and "/v1/chat/completions" in json.loads(raw)["paths"]
    golden = golden_json("tokenizer.json")
    for text, ids, decoded in list(zip(golden["strings"], golden["ids"], golden["decoded"]))[:12]:
        status, _, raw = post(server, "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200 and json.loads(raw)["tokens"] == ids and json.loads(raw)["count"] == len(ids)
        status, _, raw = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
        assert status == 200 and json.loads(raw)["prompt"] == decoded
    status, _, raw = post(server, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert json.loads(raw)["tokens"] == GREEDY["prompt_ids"]


def test_sigint_lets_an_http_and_a_grpc_stream_finish(server):
    """Last in the module: it stops the shared serve."""
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=60 * TIME_FACTOR)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once upon a time",
                 "max_tokens": 24, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    call = stub(server.target).Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=24, ignore_eos=True))
    head = next(call)
    server.popen.send_signal(signal.SIGINT)
    server.wait_for("shutting down")
    rest = list(call)
    assert rest[-1].usage.completion_tokens == 24 and len(head.token_ids) + sum(len(m.token_ids) for m in rest) == 24
    chunks = events(first + resp.read())
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert server.stop() == 0, server.text()

