"""An instant worker: the real worker process, wire and engine loop, with a
model runner that computes nothing, so that `bench gateway` measures the
gateway alone.

The worker loads the GGUF only for its fingerprint and tokenizer (a router
refuses a worker on another model). Each step "samples", for every sequence
due a token, the next id of a fixed English sentence, so the gateway's
incremental detokenizer and stop matcher do the work they do on real text.
With `step_s` > 0 every step sleeps that long first (a decode step of a
chosen length); with 0 the engine loop runs steps back to back.

A sequence with tools (constraint kind "tools") gets `TOOL_TEXT` instead: a
recorded generation in the Hermes format (text, then calls to one function,
over and over), so that `bench gateway --tools` makes the gateway's tool-call
parser do its work. The worker compiles and follows the request's grammar as a
real one does (the recorded calls are valid under `TOOL_SCHEMA`); the masks it
fills are not applied, since nothing is sampled.
"""

from __future__ import annotations

import time
from dataclasses import replace

from hybridgate.mempool.pinned import PoolStats
from hybridgate.workers.process import WorkerConfig, run_worker
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

TEXT = ("The gateway streams each token to its client as soon as the worker samples it, and the "
        "router keeps the text whole across token boundaries. ")
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                               "days": {"type": "integer"}}, "required": ["city"]}
TOOL_TEXT = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", '
             '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Zürich \\"ZH\\"", "days": 12}}\n</tool_call>\n')


class InstantRunner:
    """The `ModelRunner` protocol with no model: ids from `TEXT`, in order, per sequence.

    `num_blocks` is large so that the scheduler never waits for KV blocks
    (blocks cost nothing here: `block_bytes` is 0).
    """

    kind = "cpu"
    block_size = 16
    block_bytes = 0

    def __init__(self, model, step_s: float = 0.0, num_blocks: int = 1 << 16):
        from hybridgate.models.tokenizer import Tokenizer

        self.max_model_len = model.config.max_model_len
        self.vocab_size = model.config.vocab_size
        self.num_blocks = num_blocks
        self.step_s = step_s
        self.metadata = model.metadata  # the tokenizer the worker's grammars are compiled for
        tokenizer = Tokenizer.from_model(model)
        self.text_ids, self.tool_ids = tokenizer.encode(TEXT), tokenizer.encode(TOOL_TEXT)

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        if self.step_s:
            time.sleep(self.step_s)
        out = {}
        for s, n in batch.entries:
            if s.num_computed + n == s.num_tokens:
                tools = s.params.constraint is not None and s.params.constraint.kind == "tools"
                ids = self.tool_ids if tools else self.text_ids
                out[s] = ids[s.next_token_index % len(ids)]
        return out

    def warm_up(self, progress: bool = True) -> None:
        pass

    def pool_stats(self) -> PoolStats:
        return PoolStats()

    def kernel_cache_stats(self) -> tuple[int, int]:
        return 0, 0


def run_instant_worker(config: WorkerConfig, step_s: float = 0.0) -> None:
    """Process entry point (spawn): `run_worker` with an `InstantRunner`."""

    def build(cfg: WorkerConfig):
        from hybridgate.models import load_gguf

        model = load_gguf(cfg.model_path)
        return InstantRunner(model, step_s), model

    run_worker(replace(config, kind="cpu"), build=build)
