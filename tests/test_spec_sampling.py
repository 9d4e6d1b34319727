"""Rejection sampling of drafted tokens keeps a sampled request's distribution: the emitted tokens' counts against
the target's p by a chi-square test at fixed seeds, for a one-hot draft (prompt lookup) and for a draft drawn
from another distribution (a draft model), through the sampler's own transforms; the same test rejects a wrong
acceptance rule, so it can fail."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from engine.runtime.requests import SamplingParams
from engine.runtime.sampling import Sampler
from engine.runtime.spec_sampling import accept_probability, residual

DRAWS = 8000  # enough: the wrong rules below land 60-70x past the limit
Z_999 = 3.0902  # the standard normal's 99.9th percentile


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(Pearson's statistic of `counts` against `p`, its 99.9th percentile under p by Wilson-Hilferty).
    A token with p == 0 must never have been drawn."""
    assert int(counts[p == 0].sum()) == 0, f"drawn where p is 0: {counts.tolist()}"
    support = p > 0
    n = float(counts.sum())
    expected = p[support].double() * n
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    a = 2.0 / (9.0 * df)
    return stat, df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def _counts(step: Callable[[], int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([step() for _ in range(DRAWS)]), minlength=vocab)


P = torch.tensor([0.05, 0.30, 0.0, 0.20, 0.25, 0.10, 0.06, 0.04])
Q = torch.tensor([0.30, 0.05, 0.10, 0.25, 0.05, 0.15, 0.0, 0.10])  # a draft model's: other mass, 0 at a p > 0


def _sampled(seed: int) -> Sampler:
    return Sampler(SamplingParams(temperature=1.0, seed=seed), [])


def _wrong_redraw_from_p(p: torch.Tensor, draft: int, q: torch.Tensor | None, gen: torch.Generator) -> int:
    """A plausible mistake: keep the draft as the right rule does, but redraw a rejected one from p itself."""
    if float(torch.rand(1, generator=gen, dtype=torch.float64)) < accept_probability(p, draft, q):
        return draft
    return int(torch.multinomial(p, 1, generator=gen))


def test_one_hot_draft_keeps_the_target_distribution():
    """Prompt lookup's draft is a fixed token: kept with p(draft), else a token drawn from p without it."""
    sampler = _sampled(11)
    for draft in (1, 7):  # a likely draft and an unlikely one
        stat, limit = _chi_square(_counts(lambda d=draft: sampler.verify(P.log(), d), 8), P)
        assert stat < limit, (draft, stat, limit)


def test_drafts_drawn_from_another_distribution_keep_the_target_distribution():
    sampler, gen = _sampled(12), torch.Generator().manual_seed(5)

    def step() -> int:
        return sampler.verify(P.log(), int(torch.multinomial(Q, 1, generator=gen)), Q)

    stat, limit = _chi_square(_counts(step, 8), P)
    assert stat < limit, (stat, limit)


@pytest.mark.parametrize("q", [None, Q], ids=["one-hot", "draft-model"])
def test_the_check_rejects_a_wrong_rule(q):
    """The chi-square test above is not vacuous: redrawing a rejected draft from p over-weights the draft
    (one-hot) or the tokens the draft distribution favours, and the statistic lands far past the limit."""
    gen = torch.Generator().manual_seed(6)

    def step() -> int:
        draft = 1 if q is None else int(torch.multinomial(q, 1, generator=gen))
        return _wrong_redraw_from_p(P, draft, q, gen)

    stat, limit = _chi_square(_counts(step, 8), P)
    assert stat > 3 * limit, (stat, limit)


def test_verified_tokens_follow_the_samplers_transforms():
    """Temperature, top-k, top-p, min-p and the three penalties over a prompt history define p as plain
    sampling does: the first token of fresh samplers, plainly sampled and verified against a draft, both follow
    `distribution` (which drops what top-k, top-p and min-p exclude)."""
    params = dict(temperature=0.7, top_k=7, top_p=0.9, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.4,
                  frequency_penalty=0.2)
    prompt = [2, 3, 3, 9]
    logits = torch.tensor([1.0, 2.5, 2.0, 1.8, -1.0, 0.5, 1.5, 0.2, -3.0, 2.2, 0.0, 1.0])
    p = Sampler(SamplingParams(**params, seed=0), prompt).distribution(logits)
    assert abs(float(p.sum()) - 1.0) < 1e-6 and 3 <= int((p > 0).sum()) < 7, p.tolist()
    plain = torch.zeros(12, dtype=torch.long)
    verified = plain.clone()
    for seed in range(DRAWS // 4):
        plain[Sampler(SamplingParams(**params, seed=seed), prompt).sample(logits)] += 1
        verified[Sampler(SamplingParams(**params, seed=seed + DRAWS), prompt).verify(logits, 9)] += 1
    for counts in (plain, verified):
        stat, limit = _chi_square(counts, p)
        assert stat < limit, (counts.tolist(), stat, limit)


def test_a_one_hot_draft_is_verified_with_plain_samplings_draws():
    """Whatever is drafted, a seeded sampler emits the tokens plain sampling emits with that seed: the draft only
    decides whether the step keeps the rows after it (so drafts from other requests cannot change an answer)."""
    drafts = [1, 7, 4, 4, 0, 3] * 10
    verified, plain = _sampled(9), _sampled(9)
    assert [verified.verify(P.log(), d) for d in drafts] == [plain.sample(P.log()) for _ in drafts]


def test_a_draft_outside_the_vocabulary_is_rejected_as_plain_sampling():
    """With a draft distribution of its own (the general rule), a draft id past the logits has p = 0: rejected,
    and the token drawn from p as plain sampling draws it (a one-hot draft takes plain sampling's draw anyway)."""
    sampler, plain = _sampled(4), _sampled(4)
    assert [sampler.verify(P.log(), 8, Q) for _ in range(50)] == [plain.sample(P.log()) for _ in range(50)]


def test_greedy_verify_is_the_argmax():
    sampler = Sampler(SamplingParams(temperature=0.0), [])
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert sampler.verify(logits, 2) == 1 and sampler.verify(logits, 1) == 1
    assert sampler.distribution(logits).tolist() == [0.0, 1.0, 0.0]


def test_residual_excludes_the_rejected_draft_and_accept_probability_is_capped():
    assert residual(P, 1, None)[1] == 0.0
    assert torch.allclose(residual(P, 1, None).sum(), torch.tensor(0.70, dtype=torch.float64))
    assert accept_probability(P, 1, Q) == 1.0  # p(1) = 0.30 > q(1) = 0.05
    assert accept_probability(P, 0, Q) == pytest.approx(0.05 / 0.30)
    assert float(residual(P, 0, Q)[0]) == 0.0  # q over-proposed token 0: nothing of it left to redraw
    with pytest.raises(AssertionError, match="probability 0 under the draft"):
        accept_probability(P, 6, Q)
