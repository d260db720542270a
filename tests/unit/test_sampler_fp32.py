"""The float32 sampler (the CUDA default): greedy ids equal the numpy twin's, seeded draws follow the spec's
distributions (chi-square against probabilities computed here by the spec's definitions in float64), and the
nucleus it keeps without a whole-vocabulary sort is the spec's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridgate.wire import SamplingParams
from hybridgate.workers import sampling as np_sampler
from hybridgate.workers.gpu import sampling as torch_sampler


def test_greedy_ids_equal_the_numpy_twins_under_every_penalty():
    rng = np.random.default_rng(11)
    rows, vocab = 300, 5000
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0.0, repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
                             presence_penalty=float(rng.choice([0.0, 0.5])),
                             frequency_penalty=float(rng.choice([0.0, 0.7]))) for _ in range(rows)]
    seen = [rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist() for _ in range(rows)]
    args = (params, list(range(rows)), [0] * rows, seen)
    want = np_sampler.sample(logits, *args, generated=seen)
    got = torch_sampler.sample(torch.from_numpy(logits), *args, generated=seen, precision="fp32").numpy()
    assert (got == want).all(), np.flatnonzero(got != want)


def spec_probabilities(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The spec's sampling distribution over ids, by its definitions (float64, a full stable sort)."""
    x = logits.astype(np.float64) / p.temperature
    if p.min_p > 0:
        x = np.where(x < x.max() + math.log(p.min_p), -np.inf, x)
    if 0 < p.top_k < len(x):
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    if p.top_p < 1:
        order = np.argsort(-x, kind="stable")
        e = np.exp(x[order] - x[order][0])
        keep = (np.cumsum(e) - e) < p.top_p * e.sum()
        x[order[~keep]] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def chi_square_limit(df: int, z: float = 4.26) -> float:
    """The chi-square quantile for a one-sided normal z (4.26: p = 1e-5), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(top_k=5),
                                    SamplingParams(top_p=0.8), SamplingParams(top_k=8, top_p=0.7, temperature=1.3),
                                    SamplingParams(min_p=0.05)],
                         ids=["t1", "t0.6", "k5", "p0.8", "k8p0.7t1.3", "minp0.05"])
def test_seeded_draws_follow_the_spec_distribution(params):
    logits = np.array([1.0, 0.0, -1.0, 2.0, 0.5, 0.5, -0.3, 1.7, -2.0, 0.9, 0.1, -0.7], dtype=np.float32)
    n = 24000
    probs = spec_probabilities(logits, params)
    ids = torch_sampler.sample(torch.from_numpy(np.tile(logits, (n, 1))), [params] * n, list(range(n)), [9] * n,
                               [[]] * n, precision="fp32").numpy()
    counts = np.bincount(ids, minlength=len(logits))
    assert counts[probs == 0].sum() == 0, (counts, probs)  # nothing outside what the filters keep
    kept = probs > 0
    stat = float((((counts - n * probs) ** 2)[kept] / (n * probs[kept])).sum())
    assert stat < chi_square_limit(int(kept.sum()) - 1), (stat, counts, probs)


def test_the_nucleus_without_a_sort_is_the_specs():
    rng = np.random.default_rng(5)
    rows, vocab = 64, 6000
    scale = np.where(np.arange(rows) % 4 == 0, 0.05, rng.uniform(1.0, 6.0, rows))  # every 4th nearly flat
    x = torch.from_numpy((rng.standard_normal((rows, vocab)) * scale[:, None]).astype(np.float32))
    top_k = torch.from_numpy(np.where(np.arange(rows) % 3 == 1, 40, 0))
    top_p = torch.from_numpy(rng.choice([0.5, 0.9, 0.99, 1.0], rows).astype(np.float32))
    keep = torch_sampler.nucleus_fp32(x, top_k, top_p, 40, True).numpy()
    for r in range(rows):
        params = SamplingParams(top_k=int(top_k[r]), top_p=float(top_p[r]))
        want = spec_probabilities(x[r].numpy(), params) > 0
        differ = np.flatnonzero(keep[r] != want)
        if len(differ):  # only where float32 rounding decides: the edge token's mass-before within 1e-5 of p
            z = np.sort(x[r].numpy().astype(np.float64))[::-1]
            e = np.exp(z - z[0])
            before = (np.cumsum(e) - e) / e.sum()
            assert len(differ) == 1 and np.abs(before - float(top_p[r])).min() < 1e-5, (r, differ)
    flat = [r for r in range(0, rows, 4) if top_p[r] >= 0.9 and top_k[r] == 0]
    assert flat and max(keep[r].sum() for r in flat) > torch_sampler.CANDIDATES  # the whole-vocabulary fallback ran


def test_edges_k_one_p_one_and_ties():
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 0.0]] * 3)
    top_k, top_p = torch.tensor([1, 4, 0]), torch.tensor([1.0, 1.0, 1.0])
    keep = torch_sampler.nucleus_fp32(x, top_k, top_p, 4, False).tolist()
    assert keep == [[True, False, True, False, False, False],  # k = 1 with a tie at the top: both stay
                    [True, False, True, True, True, False],  # ties at the 4th largest stay
                    [True] * 6]  # k off, p = 1: everything
    greedy = np.array([[0.5, 2.5, -1.0, 2.4]], dtype=np.float32)
    for params in (SamplingParams(top_k=1, temperature=1.5), SamplingParams(top_p=1e-8)):
        ids = torch_sampler.sample(torch.from_numpy(np.tile(greedy, (50, 1))), [params] * 50, list(range(50)),
                                   [0] * 50, [[]] * 50, precision="fp32")
        assert ids.tolist() == [1] * 50


def test_fp32_noise_is_finite_standard_gumbel():
    keys = torch.arange(64, dtype=torch.int64) * 7919
    g = torch_sampler.gumbel_noise(keys, torch.from_numpy(np_sampler.vocab_hash(20000)), torch.float32)
    assert g.dtype == torch.float32 and torch.isfinite(g).all() and g.max() < 17.4
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(ValueError, match="precision"):
        torch_sampler.sample(torch.zeros(1, 4), [SamplingParams()], [0], [0], [[]], precision="fp16")


def test_min_p_edges_one_keeps_the_tied_top_tokens_and_a_tiny_one_keeps_all():
    """min_p keeps the tokens whose probability is at least min_p times the largest (the spec; vLLM and
    transformers' MinPLogitsWarper): at 1 only the tokens tied at the top stay, and both of those are drawn; at
    1e-12 nothing is cut: at temperature 3 the least likely token has e^(-4/3), about 0.26, of the top's
    probability and 7.5% a draw, so all five come up in 400 seeded draws (missing one: about 3e-14)."""
    x = np.array([[3.0, 1.0, 3.0, 2.0, -1.0]], dtype=np.float32)
    n = 400

    def ids(params):
        return set(torch_sampler.sample(torch.from_numpy(np.tile(x, (n, 1))), [params] * n, list(range(n)),
                                        [0] * n, [[]] * n, precision="fp32").tolist())

    assert ids(SamplingParams(temperature=1.0, min_p=1.0)) == {0, 2}
    assert ids(SamplingParams(temperature=3.0, min_p=1e-12)) == {0, 1, 2, 3, 4}
