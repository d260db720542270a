"""Resume on the torch runner in-process: a sequence re-added with the prompt plus the ids already
streamed and first_token_index=k continues exactly where the undisturbed run went (greedy, and
seeded sampling, whose noise depends only on the seed and the token index)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from hybridgate.models import model_fingerprint
from hybridgate.wire import AddRequest, FinishReason, SamplingParams
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOTAL, CUT = 24, 10
SEED = 20260601


@pytest.fixture(scope="module")
def engine(gguf_model):
    runner = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB")
    return EngineCore(runner, SchedulerConfig(), model_fingerprint(gguf_model))


def run(engine: EngineCore, request: AddRequest) -> tuple[list[int], list[int], int]:
    """(ids, the token index of each output message, finish) of one request run to its end."""
    assert engine.add(request) is None
    ids, indexes, finish = [], [], 0
    while engine.has_work():
        for seq in engine.step():
            out = output_of(seq)
            assert out.token_index == request.first_token_index + len(ids)  # contiguous, from k
            ids += out.token_ids
            indexes.append(out.token_index)
            finish = out.finish or finish
    return ids, indexes, finish


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=SEED, ignore_eos=True)],
                         ids=["greedy", "seeded-0.8"])
def test_resumed_request_continues_the_undisturbed_ids(engine, tokenizer, params):
    prompt = tokenizer.encode("The history of the printing press begins")
    whole, _, finish = run(engine, AddRequest("whole", prompt, params, SEED, TOTAL, 2))
    assert len(whole) == TOTAL and finish == FinishReason.LENGTH
    first, _, _ = run(engine, AddRequest("first", prompt, params, SEED, CUT, 2))
    assert first == whole[:CUT]  # the same runner, the same ids: the run is deterministic
    rest, indexes, finish = run(engine, AddRequest("rest", prompt + first, params, SEED, TOTAL - CUT, 2,
                                                   first_token_index=CUT))
    assert rest == whole[CUT:] and indexes[0] == CUT and finish == FinishReason.LENGTH
    assert engine.allocator.num_used == 0


def test_a_long_prefill_reports_progress_before_its_first_token(gguf_model, tokenizer):
    """Each prefill chunk that samples nothing yet is pushed as an empty output (the router's stall signal)."""
    from hybridgate.workers.engine_loop import EngineLoop, Inbox

    runner = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB")
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=32), model_fingerprint(gguf_model))
    sent = defaultdict(list)
    loop = EngineLoop(engine, Inbox(), lambda client, msg: sent[client].append(msg))
    prompt = tokenizer.encode("word " * 100)  # 100 tokens: chunks of 32, 32, 32, 4
    assert engine.add(AddRequest("long", prompt, SamplingParams(temperature=0), 0, 2, 2)) is None
    while engine.has_work():
        stepped = engine.step()
        loop._push(stepped, [s for s in engine.last_prefilled if not s.status.finished])
    outs = [o for msg in sent[b""] for o in msg.outputs]
    assert [(o.token_index, len(o.token_ids)) for o in outs] == [(0, 0), (0, 0), (0, 0), (0, 1), (1, 1)]
