"""End to end: the `vllm:*` token and finish series of a started serve, by value under a known workload."""

from __future__ import annotations

import json
import urllib.request

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import Serve, metrics, stub

PROMPT = "The capital of France is"


def test_two_requests_give_vllms_token_counts_and_finish_reasons(tmp_path, model_path, tokenizer):
    server = Serve(tmp_path / "serve.log", "--cpu-workers", "1", "--gpu-workers", "0")
    try:
        prompt_tokens = len(tokenizer.encode(PROMPT))
        msgs = list(stub(server.target).Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=6, ignore_eos=True,
                                                                    temperature=0), timeout=60 * TIME_FACTOR))
        ids = [i for m in msgs for i in m.token_ids]
        assert len(ids) == 6 and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # The same greedy answer over HTTP, cut by a stop string: the text of its 4th and 5th tokens.
        stop = tokenizer.decode(ids[3:5])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": [stop]}).encode()
        request = urllib.request.Request(server.http_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60 * TIME_FACTOR).read())
        assert answer["choices"][0]["finish_reason"] == "stop"
        generated = answer["usage"]["completion_tokens"]
        assert 3 <= generated <= 5 and answer["usage"]["prompt_tokens"] == prompt_tokens
        got = metrics(server.metrics_url)
        name = next(k for k in got if k.startswith("vllm:num_preemptions_total")).split("model_name=")[1][:-1]
        m = f"model_name={name}"
        assert got[f"vllm:prompt_tokens_total{{{m}}}"] == 2 * prompt_tokens
        assert got[f"vllm:generation_tokens_total{{{m}}}"] == 6 + generated
        assert got[f"vllm:request_prompt_tokens_count{{{m}}}"] == 2
        assert got[f"vllm:request_prompt_tokens_sum{{{m}}}"] == 2 * prompt_tokens
        assert got[f"vllm:request_generation_tokens_sum{{{m}}}"] == 6 + generated
        assert got[f"vllm:request_generation_tokens_bucket{{le=5.0,{m}}}"] == 1  # the stopped one
        assert got[f"vllm:request_generation_tokens_bucket{{le=10.0,{m}}}"] == 2
        assert got[f"vllm:request_success_total{{finished_reason=length,{m}}}"] == 1
        assert got[f"vllm:request_success_total{{finished_reason=stop,{m}}}"] == 1
        assert got[f"vllm:num_preemptions_total{{{m}}}"] == 0
    finally:
        assert server.stop() == 0, server.text()
