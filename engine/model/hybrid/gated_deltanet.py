"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear-attention layers) in plain PyTorch.

Per value head the state S [k_dim, v_dim] evolves per token t with decay a_t = exp(g_t) and rate beta_t:
    S <- a_t S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
(q, k L2-normalised, q scaled by k_dim^-1/2). Decode runs this step batched over slots. Prefill runs the
same recurrence in blocks (the chunked delta rule): within a block of L tokens starting from S0, with
G_t = sum_{s<=t} g_s, the deltas solve one unit-lower-triangular system
    (I + A) delta = beta v - beta exp(G) K S0,   A[t,s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
and o = exp(G) Q S0 + (Q K^T * exp(G_t - G_s))_{s<=t} delta, S_L = exp(G_L) S0 + K^T (exp(G_L - G) delta).
Blocks sit at absolute multiples of `BLOCK` tokens and also end at requested checkpoint positions, so the
state there is captured on the way (no second pass).

On CUDA with the optional extra `fla` installed, prefill goes through fla-core's fused kernel instead
(`fla_kernels`); this PyTorch path is the reference and the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.hybrid import fla_kernels
from engine.model.hybrid.batch import Batch, apply_conv, lanewise, segment_decay, segment_edges
from engine.model.hybrid.config import HybridConfig
from engine.model.projections import linear

BLOCK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H], state [B, H, Dk, Dv] -> (o [B, H, Dv], state)."""
    state = state * lanewise(torch.exp, g)[..., None, None]
    remembered = (state * k[..., None]).sum(-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def delta_rule_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block, head-major: q/k [H, L, Dk], v [H, L, Dv], g/beta [H, L], state [H, Dk, Dv] -> (o [H, L, Dv], state)."""
    n = q.shape[1]
    cum = g.cumsum(-1)  # [H, L]
    decay = segment_decay(g)  # exp(G_t - G_s), s <= t
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    system = eye + (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * cum.exp()[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    dv = v.shape[-1]
    delta = solved[..., :dv] - solved[..., dv:] @ state
    out = cum.exp()[..., None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ delta
    state = cum[:, -1:].exp()[..., None] * state + (k * decay[:, -1, :, None]).transpose(1, 2) @ delta
    return out, state


class GatedDeltaNetMixer(torch.nn.Module):
    """in_proj (q|k|v, z, b, a) -> short conv + SiLU on q|k|v -> gated delta rule -> RMSNorm(o) * SiLU(z) -> out_proj."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module).
    w_in: torch.Tensor
    conv: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    w_out: torch.Tensor

    def __init__(
        self, config: HybridConfig, layer: int, *, w_in: torch.Tensor, conv: torch.Tensor, a_log: torch.Tensor,
        dt_bias: torch.Tensor, norm: torch.Tensor, w_out: torch.Tensor,
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer = c, layer
        self.key_dim = c.linear_k_heads * c.linear_k_dim
        self.value_dim = c.linear_v_heads * c.linear_v_dim
        rows = 2 * self.key_dim + 2 * self.value_dim + 2 * c.linear_v_heads
        assert w_in.shape == (rows, c.hidden_size), ("w_in", tuple(w_in.shape))
        assert conv.shape == (c.conv_channels, c.conv_kernel), ("conv", tuple(conv.shape))
        assert w_out.shape == (c.hidden_size, self.value_dim), ("w_out", tuple(w_out.shape))
        for name, t in (("w_in", w_in), ("conv", conv), ("neg_a", -a_log.float().exp().to(a_log.dtype)),
                        ("dt_bias", dt_bias), ("norm", norm), ("w_out", w_out)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = self.config
        total = h.shape[0]
        hv, dk, dv = c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
        proj = linear(h, self.w_in, batch.n_single)
        conv_dim = c.conv_channels
        mixed = F.silu(apply_conv(proj[:, :conv_dim], self.conv, None, self.layer, batch))
        z = proj[:, conv_dim : conv_dim + self.value_dim].reshape(total, hv, dv)
        b = proj[:, conv_dim + self.value_dim : conv_dim + self.value_dim + hv]
        a = proj[:, conv_dim + self.value_dim + hv :]
        q = mixed[:, : self.key_dim].reshape(total, c.linear_k_heads, dk)
        k = mixed[:, self.key_dim : 2 * self.key_dim].reshape(total, c.linear_k_heads, dk)
        v = mixed[:, 2 * self.key_dim :].reshape(total, hv, dv).float()
        repeat = hv // c.linear_k_heads
        q = l2norm(q.float()) * dk**-0.5
        k = l2norm(k.float())
        if repeat > 1:  # each key head serves `repeat` consecutive value heads
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        beta = lanewise(torch.sigmoid, b.float())
        g = self.neg_a.float() * lanewise(F.softplus, a.float() + self.dt_bias.float())

        out = torch.empty(total, hv, dv, dtype=torch.float32, device=h.device)
        part = batch.state.part(self.layer, "ssm")
        n = batch.n_single
        if n:
            def step(rows: slice | torch.Tensor, before: torch.Tensor) -> torch.Tensor:
                out[rows], after = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], before.float())
                return after

            batch.step_singles(part, self.layer, "ssm", step)
        fused = fla_kernels.usable(h.device)
        for ch, lo, hi in batch.long_chunks():
            s = batch.initial(part, ch).float()
            cuts = batch.state.wanted(ch.slot, ch.start, ch.start + hi - lo)
            edges = (fla_kernels.segment_edges if fused else segment_edges)(ch.start, ch.start + hi - lo, BLOCK, cuts)
            edge_lo = lo
            for edge in edges:
                edge_hi = lo + edge - ch.start
                rows = slice(edge_lo, edge_hi)
                if fused:
                    out[rows], s = fla_kernels.chunk(q[rows], k[rows], v[rows], g[rows], beta[rows], s)
                else:
                    # Fresh contiguous copies: a view at another row offset may take another SIMD path.
                    qb, kb, vb, gb, bb = (t[rows].transpose(0, 1).contiguous() for t in (q, k, v, g, beta))
                    o, s = delta_rule_block(qb, kb, vb, gb, bb, s)
                    out[rows] = o.transpose(0, 1)
                if edge in cuts:
                    batch.state.capture(ch.slot, edge, self.layer, "ssm", s)
                edge_lo = edge_hi
            part[ch.slot] = s.to(part.dtype)
        y = out.to(h.dtype)
        yf = y.float()
        y = self.norm * (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(h.dtype)
        y = (y.float() * F.silu(z.float())).to(h.dtype)
        return linear(y.reshape(total, self.value_dim), self.w_out, batch.n_single)
