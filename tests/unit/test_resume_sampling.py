"""A resumed sequence (prompt + the ids already streamed, first_token_index k) samples what the
undisturbed one would: same noise key (seed, token index), same seen set, same budget."""

from __future__ import annotations

import numpy as np
import pytest

from hybridgate.wire import AddRequest, FinishReason, SamplingParams
from hybridgate.workers.engine import output_of
from hybridgate.workers.sampling import sample
from hybridgate.workers.sequence import Sequence, SequenceStatus

VOCAB, PROMPT, TOTAL, CUT = 500, [11, 12, 13, 14, 15], 24, 10


def run(seq: Sequence, table: np.ndarray) -> list[int]:
    """Step a sequence to its end, as the runners call the sampler; logits depend on the context length
    only (a stand-in for a model: the same context gives the same row)."""
    while not seq.status.finished:
        row = table[seq.num_tokens][None, :]
        seq.append(int(sample(row, [seq.params], [seq.seed], [seq.next_token_index], [seq.all_ids])[0]))
    return seq.output_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.5, seed=7),
])
def test_resumed_sequence_samples_the_undisturbed_ids(params):
    # Flat logits make the repetition penalty and the noise decide: a wrong seen set or index shows.
    table = np.random.default_rng(3).standard_normal((64, VOCAB)).astype(np.float32) * 0.5
    seed = 1234567890123
    whole = run(Sequence(AddRequest("a", PROMPT, params, seed, TOTAL, 2)), table)
    assert len(whole) == TOTAL
    # Reference for the seen set: transformers' penalty sees prompt + every generated id.
    resumed = Sequence(AddRequest("a", PROMPT + whole[:CUT], params, seed, TOTAL - CUT, 2, first_token_index=CUT))
    assert resumed.next_token_index == CUT
    got = run(resumed, table)
    assert got == whole[CUT:]
    assert resumed.status == SequenceStatus.FINISHED_LENGTH
    out = output_of(resumed)
    assert (out.token_index, out.token_ids, out.finish) == (CUT, whole[CUT:], int(FinishReason.LENGTH))


def test_a_different_index_draws_different_noise():
    """The check above could pass with an index that is ignored; this one shows it is not."""
    table = np.random.default_rng(3).standard_normal((64, VOCAB)).astype(np.float32) * 0.5
    params = SamplingParams(temperature=0.8)
    whole = run(Sequence(AddRequest("a", PROMPT, params, 99, TOTAL, 2)), table)
    wrong = run(Sequence(AddRequest("a", PROMPT + whole[:CUT], params, 99, TOTAL - CUT, 2)), table)
    assert wrong != whole[CUT:]
