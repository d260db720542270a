"""The sampler spec: numpy and torch agree id for id; each step matches its definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridgate.wire import SamplingParams
from hybridgate.workers import sampling as np_sampler
from hybridgate.workers.gpu import sampling as torch_sampler

TEMPERATURES = [0.0, 0.3, 1.0, 1.7]
TOP_KS = [0, -1, 1, 5, 50]
TOP_PS = [1.0, 0.95, 0.5, 1e-8]
PENALTIES = [1.0, 1.3, 0.8, 2.0]


def random_batch(rng, rows: int, vocab: int):
    logits = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4.0, size=(rows, 1))).astype(np.float32)
    params = [
        SamplingParams(
            temperature=float(rng.choice(TEMPERATURES)),
            top_k=int(rng.choice(TOP_KS)),
            top_p=float(rng.choice(TOP_PS)),
            repetition_penalty=float(rng.choice(PENALTIES)),
        )
        for _ in range(rows)
    ]
    seeds = [int(s) for s in rng.integers(0, 2**63, size=rows, dtype=np.uint64) * 2 + rng.integers(0, 2, size=rows)]
    indices = [int(i) for i in rng.integers(0, 5000, size=rows)]
    seen = [rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist() for _ in range(rows)]
    return logits, params, seeds, indices, seen


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_numpy_and_torch_give_identical_ids(vocab):
    rng = np.random.default_rng(vocab)
    rows = 1000 if vocab == 1000 else 100
    logits, params, seeds, indices, seen = random_batch(rng, rows, vocab)
    expected = np_sampler.sample(logits, params, seeds, indices, seen)
    got = torch_sampler.sample(torch.from_numpy(logits), params, seeds, indices, seen).numpy()
    assert (got == expected).all(), np.flatnonzero(got != expected)
    assert len(set(expected.tolist())) > rows // 4  # not a degenerate argmax everywhere


def test_tiny_top_p_and_top_k_one_equal_greedy():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((200, 3000)).astype(np.float32)
    greedy = logits.argmax(axis=1)
    for params in (SamplingParams(top_p=1e-8), SamplingParams(top_k=1, temperature=1.5)):
        ps = [params] * 200
        seeds, idx, seen = list(range(200)), list(range(200)), [[]] * 200
        assert (np_sampler.sample(logits, ps, seeds, idx, seen) == greedy).all()
        assert (torch_sampler.sample(torch.from_numpy(logits), ps, seeds, idx, seen).numpy() == greedy).all()


def test_repetition_penalty_definition():
    x = np_sampler.apply_repetition_penalty(np.array([2.0, -2.0, 0.5]), [0, 1, 1], 2.0)
    assert x.tolist() == [1.0, -4.0, 0.5]
    # Same through both samplers at temperature 0: token 0 drops below token 1.
    logits = np.array([[2.0, 1.5, 0.5]], dtype=np.float32)
    p = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert np_sampler.sample(logits, p, [0], [0], [[0]]).tolist() == [1]
    assert torch_sampler.sample(torch.from_numpy(logits), p, [0], [0], [[0]]).tolist() == [1]


def softmax(x):
    e = [math.exp(v - max(x)) for v in x]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), softmax([1.0, 0.0, -1.0, 2.0])),
        (SamplingParams(temperature=0.5), softmax([2.0, 0.0, -2.0, 4.0])),
        # top-k 2 keeps logits 2.0 and 1.0 and renormalises.
        (SamplingParams(top_k=2), [softmax([1.0, 2.0])[0], 0.0, 0.0, softmax([1.0, 2.0])[1]]),
        # Sorted probs .644 .237 .087 .032: mass before the third is .881 >= .7, so two stay.
        (SamplingParams(top_p=0.7), [softmax([1.0, 2.0])[0], 0.0, 0.0, softmax([1.0, 2.0])[1]]),
    ],
    ids=["t1", "t0.5", "topk2", "topp0.7"],
)
def test_frequencies_follow_the_distribution(params, expected):
    n = 20000
    logits = np.tile(np.array([1.0, 0.0, -1.0, 2.0], dtype=np.float32), (n, 1))
    # Half the draws vary the seed at a fixed index, half the index at a fixed seed.
    seeds = list(range(n // 2)) + [12345] * (n // 2)
    indices = [3] * (n // 2) + list(range(n // 2))
    ids = torch_sampler.sample(torch.from_numpy(logits), [params] * n, seeds, indices, [[]] * n).numpy()
    freq = np.bincount(ids, minlength=4) / n
    assert np.abs(freq - np.array(expected)).max() < 0.015, (freq, expected)


def test_noise_depends_only_on_seed_and_index():
    a = np_sampler.gumbel_noise(42, 7, 5000)
    assert np.array_equal(a, np_sampler.gumbel_noise(42, 7, 5000))
    assert not np.array_equal(a, np_sampler.gumbel_noise(42, 8, 5000))
    assert not np.array_equal(a, np_sampler.gumbel_noise(43, 7, 5000))
    assert not np.array_equal(a, np_sampler.gumbel_noise(42 + 2**32, 7, 5000))  # the seed's high half counts
    assert abs(a.mean() - 0.5772) < 0.05 and abs(a.std() - math.pi / math.sqrt(6)) < 0.05  # standard Gumbel


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("temperature", SamplingParams(temperature=-0.1)),
        ("temperature", SamplingParams(temperature=float("nan"))),
        ("top_p", SamplingParams(top_p=0.0)),
        ("top_p", SamplingParams(top_p=1.5)),
        ("top_k", SamplingParams(top_k=-2)),
        ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
        ("max_tokens", SamplingParams(max_tokens=0)),
        ("stop", SamplingParams(stop=tuple("abcdefghijklmnopq"))),
        ("stop", SamplingParams(stop=("x" * 257,))),
    ],
)
def test_validation_names_the_field(field, params):
    with pytest.raises(ValueError, match=field):
        params.validate()
