"""Next-token sampling: the nucleus (top_p) is the smallest set of most likely tokens whose mass reaches top_p."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.requests import SamplingParams
from engine.runtime.sampling import Sampler, _draw_one, _nucleus_entries


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The sampler's nucleus as a vocabulary-sized vector (zero outside it)."""
    kept, order = _nucleus_entries(probs, top_p)
    return torch.zeros_like(probs).scatter_(0, order, kept)


def _full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, over the whole sorted vocabulary."""
    values, order = torch.sort(probs, descending=True)
    drop = torch.cumsum(values, -1) - values > top_p
    return torch.zeros_like(probs).scatter_(0, order, values.masked_fill(drop, 0.0))


def test_a_token_whose_preceding_mass_equals_top_p_stays():
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25] + [0.0] * 100)
    kept = _nucleus(probs, 0.75)
    assert kept[:4].tolist() == [0.125, 0.5, 0.0, 0.25] or kept[:4].tolist() == [0.0, 0.5, 0.125, 0.25]
    assert int((kept > 0).sum()) == 3


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("spread", ["peaked", "flat"])
def test_nucleus_equals_the_full_sort_definition(top_p, spread):
    # Distinct values (no ties), from a few dozen likely tokens up to nearly the whole 49K vocabulary.
    n = 49152
    weights = torch.linspace(2.0, 1.0, n) if spread == "flat" else torch.linspace(8.0, 0.0, n).exp()
    probs = weights[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    probs = probs / probs.sum()
    assert torch.equal(_nucleus(probs, top_p), _full_sort_nucleus(probs, top_p))


def test_seeded_top_p_sampling_repeats_and_stays_in_the_nucleus():
    logits = torch.linspace(6.0, -6.0, 1000)
    draws = []
    for _ in range(2):
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=7), [])
        draws.append([sampler.sample(logits) for _ in range(50)])
    assert draws[0] == draws[1]
    probs = torch.softmax(logits, -1)
    allowed = set(_full_sort_nucleus(probs, 0.5).nonzero().flatten().tolist())
    assert set(draws[0]) <= allowed and len(set(draws[0])) > 1


def test_temperature_draws_follow_the_distribution_and_skip_impossible_tokens():
    """20,000 seeded draws at temperature 1: each token's share within 0.015 of its probability (about 4.5
    standard deviations at these counts), and the token at -inf never drawn."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3), [])
    counts = torch.bincount(torch.tensor([sampler.sample(probs.log()) for _ in range(20000)]), minlength=4)
    assert counts[3] == 0
    assert torch.allclose(counts[:3].float() / 20000, probs[:3], atol=0.015), counts.tolist()


def test_one_draw_never_lands_on_a_zero_entry_and_refuses_no_mass():
    gen = torch.Generator().manual_seed(0)
    probs = torch.zeros(1000)
    probs[[0, 17, 500, 999]] = torch.tensor([1e-30, 3.0, 1.0, 2.0])  # zeros around, before and between them
    drawn = {_draw_one(probs, gen) for _ in range(3000)}
    assert drawn <= {0, 17, 500, 999} and {17, 500, 999} <= drawn
    assert _draw_one(torch.zeros(10), gen) is None
    assert _draw_one(torch.tensor([0.5, float("nan")]), gen) is None
