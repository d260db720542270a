"""What each streamed message carries, over both doors of an in-process gateway on a scripted worker.

A client that falls behind gets the tokens that arrived meanwhile joined into its next message
(`RouterConfig.stream_coalesce`, on by default); `stream_interval` N sends at most one message per N ids
(the first and the last at once, as vLLM's `--stream-interval`). Either way nothing is lost, reordered
or repeated, a stop string split across a joined message still stops exactly, and the final message
comes once. The slow client is real on both doors: a gRPC channel with a 256-byte HTTP/2 window that
reads a message every few milliseconds, and an ASGI server whose `send` of each body chunk takes as
long (what uvicorn's `send` does when the client's socket is full).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import grpc
import pytest

from conftest import TIME_FACTOR
from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.models import model_fingerprint
from hybridgate.router import Router, RouterConfig
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import FinishReason, SamplingParams
from scripted import ScriptedClient

pytestmark = pytest.mark.asyncio

TEXT = "The keeper climbed the tower stairs each night, trimmed the wick and watched the ships pass by. " * 3
PAUSE_S = 0.005  # the slow client's time per message
# The slow gRPC client's HTTP/2 receive window: small, so that the door's writes wait for its reads
# (as in tests/e2e/test_coalescing.py).
SLOW_READER = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@asynccontextmanager
async def gateway(gguf_model, script: list[int], **config):
    client = ScriptedClient(model_fingerprint(gguf_model), script)
    async with Router(gguf_model, [client], RouterConfig(**config)) as router:
        gw = Gateway(router, GatewayConfig(port=0, http_port=0))
        await gw.start()
        try:
            yield gw
        finally:
            await gw.stop()


async def read_grpc(gw: Gateway, pause_s: float, max_tokens: int, stop: tuple[str, ...] = ()) -> dict:
    """One streamed request over the gRPC door: per message its ids, and the text, logprobs, finish, usage."""
    request = pb.GenerateRequest(prompt="x", max_tokens=max_tokens, stop=stop, logprobs=0)
    msgs = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=SLOW_READER if pause_s else []) as ch:
        async for m in pb_grpc.GenerationStub(ch).Generate(request, timeout=60 * TIME_FACTOR):
            msgs.append(m)
            await asyncio.sleep(pause_s)
    # token indexes contiguous: each message starts where the ones before it ended
    assert [m.token_index for m in msgs] == [sum(len(p.token_ids) for p in msgs[:k]) for k in range(len(msgs))]
    finals = [m for m in msgs if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert finals == msgs[-1:], "one final message, the last"
    last = msgs[-1]
    return {"sizes": [len(m.token_ids) for m in msgs], "ids": [t for m in msgs for t in m.token_ids],
            "text": "".join(m.text for m in msgs), "logprobs": [lp.logprob for m in msgs for lp in m.logprobs],
            "finish": FINISH[last.finish_reason],
            "usage": (last.usage.prompt_tokens, last.usage.completion_tokens)}


async def read_http(gw: Gateway, pause_s: float, max_tokens: int, stop: tuple[str, ...] = ()) -> dict:
    """`read_grpc` over the OpenAI door (/v1/completions as server-sent events, through its ASGI app):
    per message the ids it carries, from the usage every chunk has (continuous_usage_stats)."""
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stop": list(stop), "logprobs": 0, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234)}
    requests, chunks = [{"type": "http.request", "body": body, "more_body": False}], []

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.sleep(3600)  # the client stays connected

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
        elif message.get("body"):
            chunks.append(message["body"])
            await asyncio.sleep(pause_s)

    await asyncio.wait_for(gw.openai.app(scope, receive, send), 60 * TIME_FACTOR)
    events = [e.removeprefix(b"data: ") for e in b"".join(chunks).split(b"\n\n") if e]
    assert events.count(b"[DONE]") == 1 and events[-1] == b"[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    choices = [(o["choices"][0], o["usage"]["completion_tokens"]) for o in objs if o["choices"]]
    counts = [n for _, n in choices]
    finals = [c["finish_reason"] for c, _ in choices if c["finish_reason"] is not None]
    assert len(finals) == 1 and choices[-1][0]["finish_reason"] is not None, "one final message, the last"
    usage = objs[-1]["usage"]  # the usage chunk after the last choice
    assert not objs[-1]["choices"] and usage["completion_tokens"] == counts[-1]
    return {"sizes": [b - a for a, b in zip([0, *counts], counts)], "text": "".join(c["text"] for c, _ in choices),
            "logprobs": [lp for c, _ in choices for lp in c["logprobs"]["token_logprobs"]], "finish": finals[0],
            "usage": (usage["prompt_tokens"], usage["completion_tokens"])}


DOORS = {"grpc": read_grpc, "http": read_http}


def logprobs_of(n: int) -> list[float]:
    """The log-probabilities ScriptedClient sends with its first `n` ids (scripted.scripted_logprob)."""
    return [-(i + 1) / 8 for i in range(n)]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("interval", [1, 4])
async def test_a_slow_client_gets_joined_messages_equal_to_one_per_token(gguf_model, tokenizer, door, interval):
    script = tokenizer.encode(TEXT)
    n = len(script)
    async with gateway(gguf_model, script, stream_coalesce=False) as gw:
        plain = await DOORS[door](gw, 0.0, n)
    async with gateway(gguf_model, script, stream_interval=interval) as gw:
        joined = await DOORS[door](gw, PAUSE_S, n)
    assert plain["sizes"] == [1] * n  # uncoalesced: one message per worker step
    for got in (plain, joined):
        assert got["text"] == TEXT and got["finish"] == "length" and got["logprobs"] == logprobs_of(n)
        assert got["usage"] == (1, n)  # the prompt "x" is one id
    if door == "grpc":
        assert plain["ids"] == joined["ids"] == script
    # The slow client got fewer messages, the tokens that came while it read each one joined.
    assert len(joined["sizes"]) < n / 2 and sum(joined["sizes"]) == n, joined["sizes"]
    # With an interval every message between the first and the last carries at least that many ids.
    assert joined["sizes"][0] == 1 and min(joined["sizes"][1:-1], default=interval) >= interval, joined["sizes"]


@pytest.mark.parametrize("door", DOORS)
async def test_stream_interval_4_sends_4_ids_a_message(gguf_model, tokenizer, door):
    script = tokenizer.encode(TEXT)[:26]
    async with gateway(gguf_model, script, stream_coalesce=False, stream_interval=4) as gw:
        got = await DOORS[door](gw, 0.0, len(script))
    # the first id at once (TTFT), then 4 a message, the last message the 1 left: 1 + 6 x 4 + 1 = 26
    assert got["sizes"] == [1, 4, 4, 4, 4, 4, 4, 1]
    assert got["text"] == tokenizer.decode(script) and got["finish"] == "length"
    assert got["logprobs"] == logprobs_of(26)


BEFORE = "The city is "


def stop_script(tokenizer) -> tuple[list[int], int]:
    """Ids of BEFORE + "Paris" + more, "Paris" in three ids ("Pa", "r", "is") so that it spans whatever
    message boundary falls in it; and how many ids stream: up to the one that completes the stop."""
    stop_ids = tokenizer.encode("Pa") + tokenizer.encode("r") + tokenizer.encode("is")
    script = tokenizer.encode(BEFORE) + stop_ids + tokenizer.encode(" and the keeper went home to sleep.")
    return script, len(tokenizer.encode(BEFORE)) + len(stop_ids)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("config", [{}, {"stream_interval": 4}], ids=["coalesced", "interval 4"])
async def test_a_stop_string_split_across_a_joined_message_stops_exactly(gguf_model, tokenizer, door, config):
    script, completing = stop_script(tokenizer)
    async with gateway(gguf_model, script, **config) as gw:
        got = await DOORS[door](gw, PAUSE_S, len(script), stop=("Paris",))
    assert got["text"] == BEFORE and got["finish"] == "stop"
    assert sum(got["sizes"]) == completing and got["usage"] == (1, completing)
    assert got["logprobs"] == logprobs_of(completing)
    if door == "grpc":
        assert got["ids"] == script[:completing]


async def test_a_stop_inside_an_interval_ends_its_message_at_once(gguf_model, tokenizer):
    # The id completing "Paris" is the 7th (index 6), inside the third message of 4 ids (indexes 5-8); the
    # worker stalls after it. The stream stops there and then (as vLLM checks stops before its interval),
    # rather than waiting for ids 7 and 8, which never come.
    script, completing = stop_script(tokenizer)
    assert completing == 7
    client = ScriptedClient(model_fingerprint(gguf_model), script, stall_after=completing - 1)
    async with Router(gguf_model, [client], RouterConfig(stream_interval=4)) as router:
        async with router.generate("x", SamplingParams(stop=("Paris",), max_tokens=len(script))) as stream:
            deltas = await asyncio.wait_for(_all(stream), 10 * TIME_FACTOR)
    assert [len(d.token_ids) for d in deltas] == [1, 4, 2]
    assert "".join(d.text for d in deltas) == BEFORE and deltas[-1].finish_reason == FinishReason.STOP
    assert [t for d in deltas for t in d.token_ids] == script[:completing]
    assert client.aborted == [client.requests[0].request_id]


async def _all(stream) -> list:
    return [d async for d in stream]
