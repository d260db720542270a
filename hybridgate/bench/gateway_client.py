"""The client process of `hybridgate bench gateway`: N concurrent streams over the gRPC door or the OpenAI
HTTP door, timed as a client sees them.

`run_client` starts it (spawned, so that its CPU time is its own) and returns its figures: wall and CPU
seconds, each stream's TTFT, the ITL, and the counts of tokens, messages, errors, short streams and tool
calls. ITL per token as a client sees it, as SGLang's bench_serving counts it: over gRPC a message of n ids
after a gap of t seconds gives n gaps of t / n (so percentiles weigh tokens, whether or not the gateway
joined them into fewer messages); over HTTP, whose chunks carry text without a count of ids, one gap a chunk.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper."
MAX_CONNECTIONS = 16

def _client_main(target: str, concurrency: int, requests: int, max_tokens: int, conn, tls_ca: str | None = None,
                 token: str | None = None, protocol: str = "grpc", tools: bool | None = None) -> None:
    """Client process: `requests` streams, `concurrency` at a time; sends the figures back on `conn`.
    `tls_ca`: connect over TLS trusting that PEM; `token`: send it as the bearer token."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    drive = _drive_http(target, concurrency, requests, max_tokens, token, tools) if protocol == "openai" else \
        _drive(target, concurrency, requests, max_tokens, tls_ca, token, tools)
    conn.send(asyncio.run(drive))
    conn.close()


async def _drive(target: str, concurrency: int, requests: int, max_tokens: int, tls_ca: str | None = None,
                 token: str | None = None, tools: bool | None = None) -> dict:
    import grpc

    from hybridgate.v1 import generation_pb2 as pb
    from hybridgate.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 label="bench-gateway") if tools is None else _grpc_chat(max_tokens, tools)
    ttfts: list[float] = []
    itls: list[float] = []
    counts = {"tokens": 0, "messages": 0, "errors": 0, "short": 0, "tool_calls": 0}
    remaining = iter(range(requests))

    async def one(stub) -> None:
        start = last = time.perf_counter()
        tokens = 0
        try:
            async for msg in stub.Generate(request, metadata=metadata):
                now = time.perf_counter()
                n = len(msg.token_ids)
                if tokens == 0:
                    ttfts.append(now - start)
                elif n:
                    itls.extend([(now - last) / n] * n)
                last, tokens = now, tokens + n
                counts["messages"] += 1
                counts["tool_calls"] += len(msg.tool_calls)  # the last message's parsed calls
        except grpc.aio.AioRpcError:
            counts["errors"] += 1
        counts["tokens"] += tokens
        counts["short"] += tokens != max_tokens

    async def lane(stub) -> None:
        for _ in remaining:
            await one(stub)

    # One connection per lane (a local subchannel pool each), so that the kernel can spread them over
    # the gateways of `--gateways N`; with one gateway the streams' cost is the same.
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    options = [("grpc.use_local_subchannel_pool", 1)]
    credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    channels = [grpc.aio.secure_channel(target, credentials, options=options) if credentials else
                grpc.aio.insecure_channel(target, options=options) for _ in range(min(concurrency, MAX_CONNECTIONS))]
    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(pb_grpc.GenerationStub(channels[k % len(channels)])) for k in range(concurrency)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    await asyncio.gather(*(c.close() for c in channels))
    return {"wall_s": wall, "client_cpu_s": cpu, "ttft_s": ttfts, "itl_s": itls, **counts}


async def _drive_http(target: str, concurrency: int, requests: int, max_tokens: int, token: str | None = None,
                      tools: bool | None = None) -> dict:
    """`_drive` over the OpenAI HTTP door: /v1/completions streamed as server-sent events (chats: `_http_chat`)."""
    from hybridgate.bench.serve_clients import sse_post

    host, port = target.rsplit(":", 1)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}, "user": "bench-gateway"}).encode()
    path = "/v1/completions"
    if tools is not None:
        path, body = "/v1/chat/completions", _http_chat(max_tokens, tools)
    ttfts: list[float] = []
    itls: list[float] = []
    counts = {"tokens": 0, "messages": 0, "errors": 0, "short": 0, "tool_calls": 0}
    remaining = iter(range(requests))

    async def one() -> None:
        start = last = time.perf_counter()
        tokens, first = 0, True
        try:
            async for event in sse_post(host, int(port), path, body, token):
                now = time.perf_counter()
                if event == b"[DONE]":
                    break
                chunk = json.loads(event)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                calls = chunk["choices"][0].get("delta", {}).get("tool_calls") or ()
                counts["tool_calls"] += sum(1 for call in calls if call.get("id"))  # a call's first delta
                if first:
                    ttfts.append(now - start)
                    first = False
                else:
                    itls.append(now - last)
                last = now
                counts["messages"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            counts["errors"] += 1
        counts["tokens"] += tokens
        counts["short"] += tokens != max_tokens

    async def lane() -> None:
        for _ in remaining:
            await one()

    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"wall_s": wall, "client_cpu_s": cpu, "ttft_s": ttfts, "itl_s": itls, **counts}


def run_client(target: str, concurrency: int, requests: int, max_tokens: int, tls_ca: str | None = None,
                token: str | None = None, protocol: str = "grpc", tools: bool | None = None) -> dict:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client_main, name="bench-gateway-client",
                       args=(target, concurrency, requests, max_tokens, theirs, tls_ca, token, protocol, tools))
    proc.start()
    theirs.close()
    try:
        result = ours.recv()
    except EOFError:
        raise RuntimeError(f"the bench client process exited ({proc.exitcode}) without its figures") from None
    proc.join()
    return result


def _grpc_chat(max_tokens: int, tools: bool):
    """The gRPC chat request of `--tools`: with the instant worker's tool (`auto`), or without."""
    from hybridgate.bench.instant import TOOL_SCHEMA
    from hybridgate.v1 import generation_pb2 as pb

    tool = [pb.Tool(name="get_weather", parameters=json.dumps(TOOL_SCHEMA))] if tools else []
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPT)]), tools=tool,
                              max_tokens=max_tokens, temperature=0.0, ignore_eos=True, label="bench-gateway")


def _http_chat(max_tokens: int, tools: bool) -> bytes:
    """`_grpc_chat` as an OpenAI chat body, streamed."""
    from hybridgate.bench.instant import TOOL_SCHEMA

    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": "bench-gateway"}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_SCHEMA}}]
    return json.dumps(body).encode()
