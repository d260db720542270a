"""The sampler spec's OpenAI additions (presence/frequency penalties, min_p, logprobs, stop ids) in both twins,
each against a plain reference of its definition written here."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from hybridgate.wire import AddRequest, SamplingParams, SeqOutput, TokenLogprobs, decode, encode, Outputs, EngineStats
from hybridgate.workers import sampling as np_sampler
from hybridgate.workers.gpu import sampling as torch_sampler
from hybridgate.workers.sequence import Sequence, SequenceStatus


def openai_reference(logits: np.ndarray, generated: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's "Parameter details": mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = [float(v) for v in logits]
    for j in set(generated):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return np.array(out)


def reference_id(x: np.ndarray, temperature: float, seed: int, index: int, min_p: float = 0.0) -> int:
    """Gumbel-max over x / T (the spec's noise), after min-p as a probability ratio to the most likely token."""
    if temperature == 0:
        return int(np.argmax(x))
    z = x / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    return int(np.argmax(np.where(keep, z, -np.inf) + np_sampler.gumbel_noise(seed, index, len(x))))


def both(logits, params, seeds, indices, seen, generated):
    a = np_sampler.sample(logits, params, seeds, indices, seen, generated)
    b = torch_sampler.sample(torch.from_numpy(logits), params, seeds, indices, seen, generated=generated).numpy()
    return a, b


def test_penalties_follow_openais_formula_in_both_twins():
    rng = np.random.default_rng(3)
    rows, vocab = 300, 500
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    params, generated, expected = [], [], []
    for i in range(rows):
        p = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])), presence_penalty=float(rng.uniform(-2, 2)),
                           frequency_penalty=float(rng.uniform(-2, 2)))
        # few distinct ids, repeated: counts up to ~10, so frequency matters beside presence
        gen = rng.choice(rng.integers(0, vocab, 6), size=int(rng.integers(0, 40))).tolist()
        params.append(p)
        generated.append(gen)
        expected.append(reference_id(openai_reference(logits[i], gen, p.presence_penalty, p.frequency_penalty),
                                     p.temperature, i, 5))
    a, b = both(logits, params, list(range(rows)), [5] * rows, [[]] * rows, generated)
    assert a.tolist() == expected and b.tolist() == expected
    # the penalties moved the answer for a good share of rows (the check could fail)
    plain = [reference_id(logits[i].astype(np.float64), params[i].temperature, i, 5) for i in range(rows)]
    assert sum(x != y for x, y in zip(plain, expected)) > rows // 10


def test_greedy_penalty_arithmetic():
    # id 0 generated 3 times: 5 - 3 * 0.5 - 1.0 = 2.5 < 3 (id 1), so id 1 wins; with presence 0: 3.5 > 3.
    logits = np.array([[5.0, 3.0, 0.0]], dtype=np.float32)
    for presence, want in ((1.0, 1), (0.0, 0)):
        p = [SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=0.5)]
        a, b = both(logits, p, [0], [0], [[]], [[0, 0, 0]])
        assert a.tolist() == b.tolist() == [want]


def test_min_p_against_its_definition():
    rng = np.random.default_rng(11)
    rows, vocab = 300, 400
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.5])), min_p=float(rng.choice([0.0, 0.05, 0.3, 0.9])))
              for _ in range(rows)]
    expected = [reference_id(logits[i].astype(np.float64), p.temperature, 100 + i, i, p.min_p) for i, p in enumerate(params)]
    a, b = both(logits, params, [100 + i for i in range(rows)], list(range(rows)), [[]] * rows, None)
    assert a.tolist() == expected and b.tolist() == expected
    # min_p 1.0 keeps only the most likely token
    top = SamplingParams(min_p=1.0)
    a, b = both(logits, [top] * rows, list(range(rows)), [0] * rows, [[]] * rows, None)
    assert a.tolist() == b.tolist() == logits.argmax(axis=1).tolist()


def reference_logprobs(row: np.ndarray, k: int) -> tuple[list[float], list[int]]:
    x = [float(v) for v in row]
    m = max(x)
    log_z = m + math.log(math.fsum(math.exp(v - m) for v in x))
    lp = [v - log_z for v in x]
    order = sorted(range(len(x)), key=lambda j: (-lp[j], j))[:k]
    return lp, order


def test_logprobs_are_raw_log_softmax_in_both_twins():
    rng = np.random.default_rng(5)
    rows, vocab = 40, 49152
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    counts = [int(rng.integers(0, 21)) if i % 5 else None for i in range(rows)]
    # penalties and temperature change the sampled id, never the logprobs
    params = [SamplingParams(temperature=1.3, presence_penalty=1.5, repetition_penalty=1.2, logprobs=k) for k in counts]
    seen = [rng.integers(0, vocab, 30).tolist() for _ in range(rows)]
    ids_np, ids_t = both(logits, params, list(range(rows)), [0] * rows, seen, seen)
    assert ids_np.tolist() == ids_t.tolist()
    got_np = np_sampler.token_logprobs(logits, ids_np.tolist(), counts)
    got_t = torch_sampler.token_logprobs(torch.from_numpy(logits), torch.from_numpy(ids_np), counts)
    for i, k in enumerate(counts):
        if k is None:
            assert got_np[i] is None and got_t[i] is None
            continue
        lp, order = reference_logprobs(logits[i], k)
        for got in (got_np[i], got_t[i]):
            assert got.top_ids == order
            assert abs(got.logprob - lp[ids_np[i]]) < 1e-9
            assert np.allclose(got.top_logprobs, [lp[j] for j in order], atol=1e-9, rtol=0)
        assert abs(got_np[i].logprob - got_t[i].logprob) < 1e-4


def test_stop_token_ids_finish_the_sequence():
    params = SamplingParams(stop_token_ids=(7, 9))
    seq = Sequence(AddRequest("r", [1, 2], params, 0, 10, 2))
    seq.append(5)
    assert seq.status == SequenceStatus.WAITING
    seq.append(9)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_ids == [5, 9]
    # ignore_eos leaves stop ids on, as vLLM
    seq = Sequence(AddRequest("r", [1, 2], SamplingParams(stop_token_ids=(7,), ignore_eos=True), 0, 10, 2))
    seq.append(2)
    seq.append(7)
    assert seq.status == SequenceStatus.FINISHED_STOPPED


def test_generated_ids_of_a_resumed_sequence_include_the_streamed_ones():
    # prompt [1, 2, 3] plus 2 ids streamed before the move: the penalties count those two as generated
    seq = Sequence(AddRequest("r", [1, 2, 3, 40, 41], SamplingParams(), 0, 10, -1, first_token_index=2))
    seq.append(42)
    assert seq.generated_ids == [40, 41, 42]
    assert Sequence(AddRequest("r", [1, 2], SamplingParams(), 0, 10, -1)).generated_ids == []


@pytest.mark.parametrize(("field", "params"), [
    ("presence_penalty", SamplingParams(presence_penalty=2.5)),
    ("frequency_penalty", SamplingParams(frequency_penalty=-2.01)),
    ("frequency_penalty", SamplingParams(frequency_penalty=float("nan"))),
    ("min_p", SamplingParams(min_p=1.5)),
    ("stop_token_ids", SamplingParams(stop_token_ids=(-1,))),
    ("stop_token_ids", SamplingParams(stop_token_ids=tuple(range(65)))),
    ("logprobs", SamplingParams(logprobs=21)),
])
def test_validation_names_the_new_fields(field, params):
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_seq_output_carries_logprobs_and_reads_the_old_form():
    lp = TokenLogprobs(-0.25, [3, 4], [-0.25, -1.5])
    out = SeqOutput("r", 0, [3], 1, 0.5, 2, [lp])
    got = decode(encode(Outputs([out], EngineStats())))
    assert got.outputs[0].logprobs == [lp]
    assert out.tail(0, 5).token_index == 5
    old = msgspec.msgpack.encode(["r", 4, [1, 2], 0, 0.0, 0])  # a SeqOutput from before the logprobs field
    assert msgspec.msgpack.decode(old, type=SeqOutput).logprobs == []
    two = SeqOutput("r", 0, [1, 2], logprobs=[TokenLogprobs(-1.0), TokenLogprobs(-2.0)])
    assert two.tail(1, 1).token_ids == [2] and two.tail(1, 1).logprobs == [TokenLogprobs(-2.0)]
