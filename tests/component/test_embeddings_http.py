"""POST /v1/embeddings through the `openai` client and the gRPC `Embed` method: a gateway on real sockets,
a router and an in-process torch worker (fp32) on a tiny random Qwen3 written with last-token pooling. Reference:
transformers' final-norm last hidden state of the ids the router ran, L2-normalised (`hf_embedding`).
Also the refusals: `dimensions` on a model not trained to be truncated, a model whose file has no pooling
type, a bad encoding_format; each a 400 in the OpenAI error shape naming the field."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import openai
import pytest
import torch

from conftest import TIME_FACTOR
from hf_embedding import tiny_qwen3_embedder, want_embedding
from hybridgate.gateway.admission import Admission
from hybridgate.gateway.http import OpenAIApp
from hybridgate.gateway.http_server import HttpDoor
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.models import load_gguf, model_fingerprint
from hybridgate.router import Router, RouterConfig
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import PoolingType
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.inprocess import InProcessClient

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
NAME = "qwen3-embed"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path, model = tiny_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embed-http"))
    return load_gguf(path), model


def serve_and_call(gguf_model, config: RouterConfig, call):
    """Run `await call(sdk, router, stub)` against a gateway (HTTP and gRPC on free ports) over one
    in-process torch worker; its result."""
    async def main():
        runner = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB")
        async with Router(gguf_model, [InProcessClient(runner, model_fingerprint(gguf_model))], config) as router:
            gateway = Gateway(router, GatewayConfig(port=0, http_port=0, served_model_name=(NAME,)))
            await gateway.start()
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none",
                                     max_retries=0, timeout=60 * TIME_FACTOR)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                    return await call(sdk, router, pb_grpc.GenerationStub(channel))
            finally:
                await sdk.close()
                await gateway.stop()

    return asyncio.run(main())


def test_embeddings_create_round_trip(reference):
    gguf_model, model = reference
    texts = ["The capital of France is Paris.", "t", "hello world, hello"]
    ids = [[3, 77, 250, 9], [200, 201, 202]]

    async def call(sdk, router, stub):
        texts_b64 = await sdk.embeddings.create(model=NAME, input=texts)  # the client asks for base64
        texts_float = await sdk.embeddings.create(model=NAME, input=texts, encoding_format="float")
        one = await sdk.embeddings.create(model=NAME, input=texts[0])
        by_ids = await sdk.embeddings.create(model=NAME, input=ids, encoding_format="float")
        flat = await sdk.embeddings.create(model=NAME, input=ids[0])
        return texts_b64, texts_float, one, by_ids, flat, [router.tokenize(t) for t in texts]

    texts_b64, texts_float, one, by_ids, flat, text_ids = serve_and_call(gguf_model, RouterConfig(), call)
    for answer in (texts_b64, texts_float):
        assert answer.model == NAME and [d.index for d in answer.data] == [0, 1, 2]
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(t) for t in text_ids)
        for d, prompt in zip(answer.data, text_ids):
            assert np.abs(np.asarray(d.embedding) - want_embedding(model, prompt, PoolingType.LAST)).max() < TOL
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, texts_float.data[0].embedding, atol=1e-6)
    assert by_ids.usage.prompt_tokens == 7
    for d, prompt in zip(by_ids.data, ids):
        assert np.abs(np.asarray(d.embedding) - want_embedding(model, prompt, PoolingType.LAST)).max() < TOL
    assert len(flat.data) == 1 and flat.usage.prompt_tokens == 4
    assert np.allclose(flat.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)


def test_dimensions_truncate_only_a_matryoshka_model(reference):
    gguf_model, model = reference
    prompt = [10, 20, 30, 40, 50]

    async def refused(sdk, router, stub):
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.embeddings.create(model=NAME, input=prompt, dimensions=16)
        return e.value

    error = serve_and_call(gguf_model, RouterConfig(), refused)
    assert error.status_code == 400 and error.body["param"] == "dimensions"
    assert "--matryoshka" in error.body["message"]

    async def truncated(sdk, router, stub):
        answer = await sdk.embeddings.create(model=NAME, input=prompt, dimensions=16, encoding_format="float")
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.embeddings.create(model=NAME, input=prompt, dimensions=65)
        return answer, e.value

    answer, too_many = serve_and_call(gguf_model, RouterConfig(matryoshka=True), truncated)
    got = np.asarray(answer.data[0].embedding)
    assert got.shape == (16,)
    assert np.abs(got - want_embedding(model, prompt, PoolingType.LAST, dimensions=16)).max() < TOL
    assert too_many.body["param"] == "dimensions" and "[1, 64]" in too_many.body["message"]


def test_grpc_embed(reference):
    gguf_model, model = reference
    ids = [[3, 77, 250, 9], [200, 201, 202, 5, 6]]

    async def call(sdk, router, stub):
        inputs = [pb.EmbedInput(tokens=pb.TokenIds(token_ids=p)) for p in ids] + [pb.EmbedInput(text="hello")]
        answer = await stub.Embed(pb.EmbedRequest(inputs=inputs, model=NAME), timeout=60 * TIME_FACTOR)
        with pytest.raises(grpc.aio.AioRpcError) as dims:
            await stub.Embed(pb.EmbedRequest(inputs=inputs, dimensions=8))
        with pytest.raises(grpc.aio.AioRpcError) as unset:
            await stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput()]))
        with pytest.raises(grpc.aio.AioRpcError) as large:  # 16000 x (4 x 64 + 16) bytes > 4 MiB
            await stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds(token_ids=[1]))] * 16000))
        return answer, dims.value, unset.value, large.value, router.tokenize("hello")

    answer, dims, unset, large, hello = serve_and_call(gguf_model, RouterConfig(), call)
    assert answer.prompt_tokens == 9 + len(hello) and len(answer.embeddings) == 3
    for got, prompt in zip(answer.embeddings, [*ids, hello]):
        assert np.abs(np.asarray(got.values) - want_embedding(model, prompt, PoolingType.LAST)).max() < TOL
    assert dims.code() == grpc.StatusCode.INVALID_ARGUMENT and dims.details().startswith("dimensions:")
    assert unset.code() == grpc.StatusCode.INVALID_ARGUMENT and unset.details() == "inputs[0]: set text or tokens"
    assert large.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "16000 vectors of 64 floats" in large.details()


def test_the_pooling_setting_overrides_the_file(reference):
    gguf_model, model = reference
    prompt = [10, 20, 30, 40, 50, 60]

    async def call(sdk, router, stub):
        return await sdk.embeddings.create(model=NAME, input=prompt, encoding_format="float")

    answer = serve_and_call(gguf_model, RouterConfig(pooling="mean"), call)
    want = want_embedding(model, prompt, PoolingType.MEAN)
    assert np.abs(np.asarray(answer.data[0].embedding) - want).max() < TOL


def test_a_model_without_pooling_and_bad_fields_are_refused(gguf_model):
    # The default model's file has no pooling type: refused before any worker is asked (none is here).
    async def main():
        router = Router(gguf_model, [], RouterConfig(prompt_processes=0))
        door = HttpDoor(OpenAIApp(router, GatewayMetrics(), Admission(8), ("m",)).app, "127.0.0.1", 0, 1.0)
        await door.start()
        sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key="none", max_retries=0)
        errors = []
        try:
            for kwargs in ({"input": "hello"}, {"input": "hello", "encoding_format": "float16"}, {"input": []}):
                with pytest.raises(openai.BadRequestError) as e:
                    await sdk.embeddings.create(model="m", **kwargs)
                errors.append(e.value.body)
        finally:
            await sdk.close()
            await door.stop()
            router.prompts.close()
        return errors

    no_pooling, bad_format, empty = asyncio.run(main())
    assert no_pooling["param"] == "model" and "llama.pooling_type is 0" in no_pooling["message"]
    assert "--pooling" in no_pooling["message"] and no_pooling["type"] == "invalid_request_error"
    assert bad_format["param"] == "encoding_format"
    assert empty["param"] == "input" and "1 to 2048" in empty["message"]
