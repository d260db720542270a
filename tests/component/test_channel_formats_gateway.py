"""Harmony and Gemma 4 outputs through a whole in-process gateway: a scripted worker replays the ids of a recorded
generation (tests/golden/channel_outputs.json) and the router serves the model as if it wrote that format; the
OpenAI SDK (streamed and not) and gRPC get the recorded reasoning, content and calls, the reasoning apart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import openai
import pytest

from conftest import TIME_FACTOR
from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.models import model_fingerprint
from hybridgate.router import Router, RouterConfig
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import FinishReason
from scripted import ScriptedClient

SAMPLES = json.loads((Path(__file__).parents[1] / "golden" / "channel_outputs.json").read_text())
CASES = [(fmt, s) for fmt in ("harmony", "gemma4") for s in SAMPLES[fmt]
         if s["name"] in ("preamble_and_two_calls", "reasoning_then_answer", "thinking_and_two_calls")]
CHAT = [{"role": "user", "content": "What is the weather in Paris, and 1 + 2?"}]


def arguments(fmt: str, args) -> str:
    return args if fmt == "harmony" else json.dumps(args, ensure_ascii=False)


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=[f"{f}-{s['name']}" for f, s in CASES])
def test_a_recorded_generation_through_the_gateway(gguf_model, tokenizer, fmt, sample):
    # SmolLM2 has none of these control tokens: their text is encoded as plain pieces, which the detokenizer
    # gives back as the same text, so the parser sees what it would see from the real model.
    script = tokenizer.encode(sample["text"], special_tokens=False)
    assert tokenizer.decode(script) == sample["text"]
    want_calls = [(name, arguments(fmt, args)) for name, args in sample["calls"]]

    async def main():
        client = ScriptedClient(model_fingerprint(gguf_model), script, finish=FinishReason.STOP)  # every request
        async with Router(gguf_model, [client], RouterConfig(tool_call_format=fmt, prompt_processes=1)) as router:
            gateway = Gateway(router, GatewayConfig(port=0, http_port=0, served_model_name=("m",)))
            await gateway.start()
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none",
                                     max_retries=0, timeout=60 * TIME_FACTOR)
            try:
                whole = await sdk.chat.completions.create(model="m", messages=CHAT)
                chunks = [c async for c in await sdk.chat.completions.create(model="m", messages=CHAT, stream=True)]
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT]))
                    responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(request)]
                return whole, chunks, responses
            finally:
                await sdk.close()
                await gateway.stop()

    whole, chunks, responses = asyncio.run(main())
    message = whole.choices[0].message
    assert (message.model_extra.get("reasoning_content") or "") == sample["reasoning"]
    assert (message.content or "") == sample["content"]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == want_calls
    assert whole.choices[0].finish_reason == ("tool_calls" if want_calls else "stop")

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == sample["reasoning"]
    assert "".join(d.content or "" for d in deltas) == sample["content"]
    assert [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []] == want_calls

    assert "".join(r.reasoning_content for r in responses) == sample["reasoning"]
    assert "".join(r.text for r in responses) == sample["content"]
    assert [(c.name, c.arguments) for c in responses[-1].tool_calls] == want_calls
