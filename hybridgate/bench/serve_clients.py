"""`bench serve`'s load generators: prompts of a given token count from seeded random words, and the clients
that send a workload at its arrival times over gRPC or the OpenAI HTTP API and time every request."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

from hybridgate.bench import workload as wl

WORDS = ("apple river stone cloud field green music table window garden silver orange market winter paper "
         "summer forest bridge yellow letter mountain doctor animal castle rabbit engine island planet school "
         "ocean travel circle wonder pocket candle button dragon flower hammer jacket mirror needle pencil "
         "rocket shadow spider sugar tiger violin wallet zebra basket butter camera coffee dinner energy "
         "finger guitar honey kitten lemon monkey nature number orbit parrot puzzle quiet robot salad").split()
PROBE_MAX_TOKENS = 32


class Prompts:
    """Text of a given token count, from seeded random words; `text(n, key)` differs for every key."""

    def __init__(self, model_path: str):
        from hybridgate.models import Tokenizer, load_gguf

        self.tokenizer = Tokenizer.from_model(load_gguf(model_path))

    def text(self, tokens: int, key: int) -> str:
        rng = random.Random(key)
        words = " ".join(rng.choice(WORDS) for _ in range(tokens + 8))
        ids = self.tokenizer.encode(f"Summarize, item {key}: {words}")[:tokens]
        return self.tokenizer.decode(ids)


class Client:
    """The gRPC side: one channel, requests sent at their arrival times."""

    def __init__(self, target: str, prompts: Prompts):
        self.target, self.prompts = target, prompts
        self.runs = 0

    async def run(self, items: list[wl.WorkItem], arrivals: list[float], limit_s: float,
                  progress: str = "") -> list[wl.Outcome]:
        """Every item's outcome; a request still open `limit_s` after the last arrival is cut off (not ended)."""
        import grpc

        from hybridgate.v1 import generation_pb2 as pb
        from hybridgate.v1 import generation_pb2_grpc as pb_grpc

        texts, outcomes, bar = self._begin(items, arrivals, progress)
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            start = time.perf_counter()

            async def one(i: int) -> None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                o, sent = outcomes[i], time.perf_counter()
                o.arrival_s = sent - start
                request = pb.GenerateRequest(prompt=texts[i], max_tokens=items[i].max_tokens, temperature=0.0,
                                             ignore_eos=True, label="bench-serve")
                call = stub.Generate(request)
                try:
                    async for msg in call:
                        now = time.perf_counter()
                        if msg.token_ids and o.ttft_s is None:
                            o.ttft_s = now - sent
                        o.tokens += len(msg.token_ids)
                        if msg.token_ids:
                            o.marks.append((now - sent, msg.token_index + len(msg.token_ids)))
                        if msg.finish_reason:
                            o.e2e_s, o.ended = now - sent, True
                    o.plan = dict(await call.trailing_metadata()).get("hybridgate-plan", "")
                except grpc.aio.AioRpcError as exc:
                    o.ended, o.error = True, exc.code().name
                except asyncio.CancelledError:
                    call.cancel()
                    raise
                finally:
                    bar.update(1)

            await _send_all(one, arrivals, limit_s)
        bar.close()
        return outcomes

    def _begin(self, items: list[wl.WorkItem], arrivals: list[float], progress: str):
        """A run's prompt texts (unique to the run), its empty outcomes and its progress bar."""
        self.runs += 1
        key = self.runs * 1_000_003 + int(time.time())
        texts = [self.prompts.text(it.prompt_tokens, key + i) for i, it in enumerate(items)]
        return texts, [wl.Outcome(it, t) for it, t in zip(items, arrivals)], progress_bar(len(items), progress)

    async def probe(self, prompt_tokens: int, repeats: int = 2) -> tuple[float, float]:
        """(TTFT, TPOT) medians of `repeats` requests one at a time, seconds."""
        runs = [(await self.run([wl.WorkItem("probe", prompt_tokens, PROBE_MAX_TOKENS)], [0.0], 600.0))[0]
                for _ in range(repeats)]
        bad = [o for o in runs if not o.ended or o.error or o.ttft_s is None]
        if bad:
            raise RuntimeError(f"an unloaded probe of {prompt_tokens} prompt tokens failed: "
                               f"{bad[0].error or 'cut off'}")
        return statistics.median(o.ttft_s for o in runs), statistics.median(o.tpot_s for o in runs)


class OpenAIClient(Client):
    """The HTTP side (--protocol openai): /v1/completions streamed as server-sent events over plain asyncio
    streams (no client library's own cost in the figures); tokens counted from the usage of every chunk
    (vLLM's continuous_usage_stats), so each chunk's ids are timed as gRPC's are."""

    async def run(self, items: list[wl.WorkItem], arrivals: list[float], limit_s: float,
                  progress: str = "") -> list[wl.Outcome]:
        texts, outcomes, bar = self._begin(items, arrivals, progress)
        host, port = self.target.rsplit(":", 1)
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            o, sent = outcomes[i], time.perf_counter()
            o.arrival_s = sent - start
            body = json.dumps({"prompt": texts[i], "max_tokens": items[i].max_tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                               "user": "bench-serve"}).encode()
            try:
                async for event in sse_post(host, int(port), "/v1/completions", body):
                    now = time.perf_counter()
                    if event == b"[DONE]":
                        o.e2e_s, o.ended = now - sent, True
                        break
                    chunk = json.loads(event)
                    if "error" in chunk:
                        o.ended, o.error = True, str(chunk["error"].get("type"))
                        break
                    if chunk.get("choices") and chunk["choices"][0]["text"] and o.ttft_s is None:
                        o.ttft_s = now - sent
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                        if chunk.get("choices") and n > o.tokens:
                            o.marks.append((now - sent, n))
                        o.tokens = n
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                o.ended, o.error = True, type(exc).__name__
            finally:
                bar.update(1)

        await _send_all(one, arrivals, limit_s)
        bar.close()
        return outcomes


async def sse_post(host: str, port: int, path: str, body: bytes, token: str | None = None):
    """The `data:` payloads of one POST's event stream (HTTP/1.1, chunked); raises ValueError on a status other
    than 200 (its body in the message). `token`: sent as `Authorization: Bearer` (None: no header)."""
    reader, writer = await asyncio.open_connection(host, port)
    auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"%sConnection: close\r\n\r\n" % (path.encode(), host.encode(), len(body), auth) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise ValueError(head.split(b"\r\n", 1)[0].decode() + " " + (await reader.read(2000)).decode())
        buf = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            buf += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                yield event.removeprefix(b"data: ")
    finally:
        writer.close()


async def _send_all(one, arrivals: list[float], limit_s: float) -> None:
    """`one(i)` for every request at once (each sleeps until its arrival); those still open `limit_s` after the
    last arrival are cancelled."""
    tasks = [asyncio.create_task(one(i)) for i in range(len(arrivals))]
    _, pending = await asyncio.wait(tasks, timeout=(arrivals[-1] if arrivals else 0) + limit_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def make_client(protocol: str, target: str, http_target: str, prompts: Prompts) -> Client:
    """The load generator of --protocol: gRPC to `target`, or the OpenAI HTTP API at `http_target`."""
    return OpenAIClient(http_target, prompts) if protocol == "openai" else Client(target, prompts)


def progress_bar(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False, disable=None, file=sys.stderr)
