"""Mamba-2 (SSD) layers in plain PyTorch (Granite-4.0-H; Nemotron-H and Falcon-H1 use the same mixer).

Per head h the state S [head_dim, state_dim] evolves per token with step dt_t = clamp(softplus(dt + dt_bias)):
    S <- exp(dt_t A_h) S + dt_t x_t B_t^T;   y_t = S C_t + D_h x_t
(B, C are shared by the heads of a group). Decode runs this step batched over slots. Prefill runs it in
blocks (the SSD chunked scan): within a block starting from S0, with G_t = sum_{s<=t} dt_s A,
    y = exp(G) C S0^T + ((C B^T) * exp(G_t - G_s) * dt_s)_{s<=t} x + D x
    S_L = exp(G_L) S0 + (x * exp(G_L - G) dt)^T B
Blocks sit at absolute multiples of the model's `mamba_chunk` and also end at requested checkpoint
positions, where the state is captured (no second pass). The output goes through a gated, grouped RMSNorm
(y * SiLU(z), normalised per group) before out_proj, or as Falcon-H1 configures it (`HybridConfig.mamba_norm`):
normalised per group and then gated, or only gated (no norm weight at all).

mamba-ssm's fused kernels could replace `ssd_block` / `ssd_step` on CUDA behind an optional extra; this
PyTorch path is the reference and the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.hybrid.batch import Batch, apply_conv, lanewise, segment_decay, segment_edges
from engine.model.hybrid.config import HybridConfig
from engine.model.projections import linear


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [R, H, P], dt [R, H], a [H], b/c [R, H, N], state [R, H, P, N] -> (y [R, H, P], state)."""
    decay = lanewise(torch.exp, dt * a)[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return (state * c[:, :, None, :]).sum(-1), state


def ssd_block(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block, head-major: x [H, L, P], dt [H, L], a [H], b/c [H, L, N], state [H, P, N] -> (y [H, L, P], state)."""
    log_decay = dt * a[:, None]  # [H, L]
    cum = log_decay.cumsum(-1)
    decay = segment_decay(log_decay)  # exp(G_t - G_s), s <= t
    scores = (c @ b.transpose(1, 2)) * decay * dt[:, None, :]
    y = cum.exp()[..., None] * (c @ state.transpose(1, 2)) + scores @ x
    to_end = decay[:, -1]  # exp(G_L - G_s)
    state = cum[:, -1:].exp()[..., None] * state + (x * (to_end * dt)[..., None]).transpose(1, 2) @ b
    return y, state


class Mamba2Mixer(torch.nn.Module):
    """in_proj (z, x|B|C, dt) -> short conv + SiLU on x|B|C -> SSD scan (+ D skip) -> gated grouped RMSNorm -> out_proj."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module).
    w_in: torch.Tensor
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    neg_a: torch.Tensor
    d_skip: torch.Tensor
    norm: torch.Tensor | None
    in_scale: torch.Tensor | None
    w_out: torch.Tensor

    def __init__(
        self, config: HybridConfig, layer: int, *, w_in: torch.Tensor, conv: torch.Tensor,
        conv_bias: torch.Tensor | None, a_log: torch.Tensor, dt_bias: torch.Tensor, d_skip: torch.Tensor,
        norm: torch.Tensor | None, w_out: torch.Tensor, in_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer = c, layer
        self.inner = c.mamba_heads * c.mamba_head_dim
        assert w_in.shape == (self.inner + c.conv_channels + c.mamba_heads, c.hidden_size), ("w_in", tuple(w_in.shape))
        assert conv.shape == (c.conv_channels, c.conv_kernel), ("conv", tuple(conv.shape))
        assert w_out.shape == (c.hidden_size, self.inner), ("w_out", tuple(w_out.shape))
        assert (norm is None) == (c.mamba_norm == "gate_only"), "a norm weight exactly when the output is normalised"
        for name, t in (("w_in", w_in), ("conv", conv), ("conv_bias", conv_bias), ("dt_bias", dt_bias),
                        ("neg_a", -a_log.float().exp()), ("d_skip", d_skip), ("norm", norm), ("w_out", w_out),
                        ("in_scale", in_scale)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = self.config
        total = h.shape[0]
        heads, p, g, n_state = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state_dim
        proj = linear(h, self.w_in, batch.n_single)
        if self.in_scale is not None:  # Falcon-H1's per-row multipliers, after the projection as transformers does
            proj = proj * self.in_scale
        z = proj[:, : self.inner]
        xbc = F.silu(apply_conv(proj[:, self.inner : self.inner + c.conv_channels], self.conv, self.conv_bias,
                                self.layer, batch))
        dt = lanewise(F.softplus, proj[:, self.inner + c.conv_channels :].float() + self.dt_bias.float())
        dt = dt.clamp(c.mamba_dt_min, c.mamba_dt_max)
        x = xbc[:, : self.inner].reshape(total, heads, p).float()
        repeat = heads // g
        b = xbc[:, self.inner : self.inner + g * n_state].reshape(total, g, n_state).float()
        cc = xbc[:, self.inner + g * n_state :].reshape(total, g, n_state).float()
        b, cc = b.repeat_interleave(repeat, dim=1), cc.repeat_interleave(repeat, dim=1)
        a = self.neg_a

        y = torch.empty(total, heads, p, dtype=torch.float32, device=h.device)
        part = batch.state.part(self.layer, "ssm")
        n = batch.n_single
        if n:
            def step(rows: slice | torch.Tensor, before: torch.Tensor) -> torch.Tensor:
                y[rows], after = ssd_step(x[rows], dt[rows], a, b[rows], cc[rows], before.float())
                return after

            batch.step_singles(part, self.layer, "ssm", step)
        for ch, lo, hi in batch.long_chunks():
            s = batch.initial(part, ch).float()
            cuts = batch.state.wanted(ch.slot, ch.start, ch.start + hi - lo)
            edge_lo = lo
            for edge in segment_edges(ch.start, ch.start + hi - lo, c.mamba_chunk, cuts):
                rows = slice(edge_lo, lo + edge - ch.start)
                # Fresh contiguous copies: a view at another row offset may take another SIMD path.
                xs, dts, bs, cs = (t[rows].transpose(0, 1).contiguous() for t in (x, dt, b, cc))
                out, s = ssd_block(xs, dts, a, bs, cs, s)
                y[rows] = out.transpose(0, 1)
                if edge in cuts:
                    batch.state.capture(ch.slot, edge, self.layer, "ssm", s)
                edge_lo = rows.stop
            part[ch.slot] = s.to(part.dtype)
        y = y + self.d_skip.float()[:, None] * x
        gate = F.silu(z.float())
        if c.mamba_norm == "gate_only":  # Falcon-H1 without mamba_rms_norm
            return linear((y.reshape(total, self.inner) * gate).to(h.dtype), self.w_out, batch.n_single)
        gated = y.reshape(total, self.inner)
        if c.mamba_norm == "gated":
            gated = gated * gate
        grouped = gated.view(total, g, self.inner // g)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        assert self.norm is not None  # normalised (asserted in __init__)
        out = self.norm * grouped.view(total, self.inner).to(h.dtype)
        if c.mamba_norm == "norm_then_gate":
            out = out * gate.to(h.dtype)
        return linear(out, self.w_out, batch.n_single)
