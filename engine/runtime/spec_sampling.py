"""Rejection sampling of a drafted token (Leviathan et al. 2023, Chen et al. 2023): the step that keeps a sampled
request's output distributed exactly as the target model's own sampling, whatever proposed the draft.

At a drafted position the target's distribution is p (the request's sampler transforms applied: penalties,
temperature, top-k, min-p, top-p) and the draft token d was drawn from a draft distribution q. The target keeps
d with probability min(1, p(d) / q(d)); otherwise it emits a token drawn from the residual max(0, p - q),
normalised. Summed over both branches each token t comes out with probability min(p(t), q(t)) + (p(t) - q(t))+
= p(t). A rejected draft's residual is zero at d, so the emitted token equals d exactly when d was kept, and the
scheduler can tell acceptance by comparing tokens as it does for greedy drafts.

Our drafters (prompt lookup, a draft model's and the next-token layer's argmax) propose d as a function of the
tokens alone: q is one-hot at d (passed as None), so d is kept with probability p(d) and a rejection draws from p
with d removed. Sampler.verify gets exactly that by drawing the token from p as decoding does and keeping d when
the draw is d, which also uses the seeded generator as decoding does. The rule below serves a drafter that draws
from a q of its own.
"""

from __future__ import annotations

import torch


def accept_probability(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> float:
    """min(1, p(draft) / q(draft)) for `p` and `q` over the vocabulary (each >= 0 with a positive total, not
    necessarily 1); `q` None: one-hot at `draft`. The draft must be possible under q (it was drawn from it)."""
    _check(p, draft, q)
    pd = float(p[draft]) / float(p.sum(dtype=torch.float64))
    if q is None:
        return min(1.0, pd)
    qd = float(q[draft]) / float(q.sum(dtype=torch.float64))
    assert qd > 0.0, f"draft token {draft} has probability 0 under the draft distribution it was drawn from"
    return min(1.0, pd / qd)


def residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """What a rejected draft's replacement is drawn from: max(0, p - q) of the normalised distributions (any
    positive total; zero at `draft`). Where it has no mass (p equals q up to rounding, so a draft was all but
    certain to be kept) it is p itself, which is then exact to the same rounding."""
    _check(p, draft, q)
    pn = p.double() / p.sum(dtype=torch.float64)
    if q is None:
        rest = pn.clone()
        rest[draft] = 0.0
    else:
        rest = (pn - q.double() / q.sum(dtype=torch.float64)).clamp_(min=0.0)
    return rest if float(rest.sum()) > 0.0 else pn


def _check(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> None:
    assert p.dim() == 1 and 0 <= draft < p.numel(), (tuple(p.shape), draft)
    assert q is None or q.shape == p.shape, f"draft distribution over {tuple(q.shape)}, target over {tuple(p.shape)}"
