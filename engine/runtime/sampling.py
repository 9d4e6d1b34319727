"""Next-token choice from logits: penalties, temperature, top-k, top-p, min-p, seeded randomness."""

from __future__ import annotations

from collections import Counter

import torch

from engine.runtime.requests import SamplingParams
from engine.runtime.spec_sampling import accept_probability, residual


class Sampler:
    """Samples one request's tokens; owns its random generator so a seed reproduces the same text."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int]) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            self.generator.manual_seed(seed)
        self._history = list(prompt_tokens[-params.repeat_last_n :]) if params.repeat_last_n > 0 else []
        self._counts: Counter[int] = Counter()

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from a [vocab] float32 tensor (any device) and remember it for penalties."""
        logits = self._penalised(logits)
        token = int(torch.argmax(logits).item()) if self.params.greedy else self._draw(logits.to("cpu"))
        self._remember(token)
        return token

    def verify(self, logits: torch.Tensor, draft: int, q: torch.Tensor | None = None) -> int:
        """The token chosen at a drafted position whose logits are `logits`, remembered as `sample` remembers:
        `draft` when the target keeps it, else another. Greedy: the argmax, as `sample`. A draft chosen without
        randomness (`q` None: prompt lookup's, a draft model's and the next-token layer's argmax): `sample`'s own
        draw, the draft kept when the draw is it. That is rejection sampling against a q one-hot at the draft
        (kept with probability p(draft), else a token from p without it), and it draws from the generator exactly
        as decoding without the draft does, so a seeded answer does not depend on what was drafted (from the
        engine's recent answers, say). Otherwise rejection sampling against `q` (engine/runtime/spec_sampling.py)."""
        if self.params.greedy or q is None or not 0 <= draft < logits.numel():
            # a draft outside the logits (a prompt token the output layer does not cover) has p = 0: the rule
            # rejects it and draws from p itself, which is what `sample` does
            return self.sample(logits)
        p = self.distribution(logits)
        u = float(torch.rand(1, generator=self.generator, dtype=torch.float64))
        if u < accept_probability(p, draft, q):
            token = draft
        else:
            drawn = _draw_one(residual(p, draft, q), self.generator)
            assert drawn is not None, "a residual always has mass"
            token = drawn
        self._remember(token)
        return token

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities `sample` would draw the next token with (penalties, temperature, top-k, min-p,
        top-p applied; one-hot at its choice when greedy or when no token keeps any mass), as a float32 [vocab]
        tensor on the CPU summing to 1. Remembers nothing."""
        logits = self._penalised(logits).to("cpu")
        if not self.params.greedy:
            weights, order, scaled = self._weights(logits)
            total = weights.sum()
            if torch.isfinite(total) and total > 0:
                dense = weights if order is None else torch.zeros_like(logits).scatter_(0, order, weights)
                return dense / total
            logits = scaled  # _draw's fallback: the argmax of the scaled, top-k-masked logits
        return torch.zeros_like(logits).scatter_(0, torch.argmax(logits).reshape(1), 1.0)

    def _penalised(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits.float()
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            logits = logits.to("cpu", copy=True)
            self._apply_penalties(logits)
        return logits

    def _apply_penalties(self, logits: torch.Tensor) -> None:
        p = self.params
        if p.repeat_penalty != 1.0 and self._history:
            ids = torch.tensor(sorted(set(self._history)), dtype=torch.long)
            vals = logits[ids]
            logits[ids] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = torch.tensor(list(self._counts.keys()), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts

    def _draw(self, logits: torch.Tensor) -> int:
        weights, order, scaled = self._weights(logits)
        token = _draw_one(weights, self.generator)
        if token is None:
            return int(torch.argmax(scaled).item())
        return token if order is None else int(order[token])

    def _weights(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(weights the next token is drawn with, in proportion; their token ids, None when they are the whole
        vocabulary; the scaled and top-k-masked logits, whose argmax is the choice when no weight is positive)."""
        p = self.params
        logits = logits / max(p.temperature, 1e-5)
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        order = None
        if p.top_p < 1.0:  # draw among the nucleus' few sorted entries, not over the whole vocabulary
            probs, order = _nucleus_entries(probs, p.top_p)
        return probs, order, logits

    def _remember(self, token: int) -> None:
        if self.params.repeat_last_n > 0:
            self._history.append(token)
            if len(self._history) > self.params.repeat_last_n:
                del self._history[0]
        self._counts[token] += 1


def _draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """One index drawn with probability proportional to `probs` (>= 0, any total), or None when the total is
    not a positive finite number.

    Inverts the running sum at one uniform number: a cumulative sum and a binary search. torch.multinomial
    draws one exponential number per entry instead, 1.4 of the 1.5 ms a temperature-sampled token took at a
    49K vocabulary (10 % of a CPU decode step). A zero entry is never drawn: its running sum equals the one
    before it, so the search (the first sum past the number) stops earlier."""
    cdf = torch.cumsum(probs, dim=0)
    total = cdf[-1]
    if not torch.isfinite(total) or total <= 0:
        return None
    target = torch.rand(1, generator=generator, dtype=cdf.dtype) * total
    index = int(torch.searchsorted(cdf, target, right=True))
    if index >= probs.numel():  # the product rounded up to the total itself (about once in 2**24 draws)
        index = int(probs.nonzero()[-1])
    return index


def _nucleus_entries(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, token ids) of the most likely tokens, largest first, those outside the nucleus zeroed:
    the smallest set of most likely tokens whose mass reaches top_p (the first token always stays).

    Sorting the whole vocabulary took ~5 ms a token at 49K entries, a third of a CPU decode step; the set
    almost always lies within the top few dozen tokens, so the search starts there and widens only when their
    mass is not past top_p (a token whose preceding mass equals top_p exactly still belongs to the set).
    """
    n = probs.numel()
    k = min(n, 64)
    while True:
        values, order = torch.topk(probs, k)  # sorted, largest first
        cumulative = torch.cumsum(values, dim=-1)
        if k == n or float(cumulative[-1]) > top_p:
            break
        k = min(n, k * 8)
    drop = cumulative - values > top_p
    return values.masked_fill(drop, 0.0), order

