"""`build_step_inputs`' prompt rows: the rows the CPU runner multiplies on AMX tiles, chosen per request."""

from __future__ import annotations

import numpy as np

from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence
from hybridgate.workers.step_inputs import build_step_inputs


def _seq(name: str, prompt: int, computed: int, outputs: int = 0) -> Sequence:
    s = Sequence(AddRequest(name, list(range(1, prompt + 1)), SamplingParams(temperature=0), 0, 64, -1))
    s.output_ids = [7] * outputs
    s.num_computed = computed
    s.block_table = list(range(8 * int(name), 8 * int(name) + 8))
    return s


def test_prompt_rows_are_the_prompt_tokens_of_long_prompts_whatever_the_batch():
    decode = _seq("0", 40, 41, outputs=2)  # a decode: its token is generated (row 0)
    short = _seq("1", 20, 0)  # a whole prompt under the length: rows 1-20, none
    chunk = _seq("2", 50, 10)  # a long prompt's middle chunk of 16: rows 21-36, all prompt tokens
    tail = _seq("3", 34, 30, outputs=3)  # a recompute: 4 prompt tokens (rows 37-40), then 3 generated
    batch = ScheduledBatch([(decode, 1), (short, 20), (chunk, 16), (tail, 7)])
    inputs = build_step_inputs(batch, 16, None, 0, long_prompt=32)
    np.testing.assert_array_equal(inputs.prompt_rows, [*range(21, 37), 37, 38, 39, 40])
    assert build_step_inputs(batch, 16, None, 0).prompt_rows.size == 0  # none asked: none listed
    alone = build_step_inputs(ScheduledBatch([(chunk, 16)]), 16, None, 0, long_prompt=32)
    np.testing.assert_array_equal(alone.prompt_rows, np.arange(16))  # the same tokens, wherever they sit
