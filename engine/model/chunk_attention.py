"""Attention over a chunk's slot rows, as the eager forward (engine/model/llama.py) runs it: RoPE rows for the
chunk's positions, which mask each chunk takes (none, causal from row 0, an offset mask, a sliding window's), one
query row against its slot's rows, SDPA for a chunk, and gpt-oss's softmax with a sink logit per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.rope import RotaryTable
from engine.model.sliding import window_mask

if TYPE_CHECKING:
    from engine.model.llama import SeqChunk

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def rope_rows(
    table: RotaryTable, max_pos: int, pos: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of `pos` as [tokens, 1, head_dim], sin in the rolled-sign form the eager forward uses."""
    cos, sin = table.get(max_pos, device, dtype)
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    half = cos.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@dataclass(slots=True)
class AttentionPlans:
    """Each chunk's masks, made once per forward and read by every layer."""

    offsets: list[int]
    causal: list[bool]
    masks: dict[int, torch.Tensor]
    window_causal: list[bool]  # the same for the sliding layers (empty for a model without them)
    window_masks: dict[int, torch.Tensor]


def attention_plans(chunks: list[SeqChunk], lengths: list[int], offsets: list[int], window: int | None) -> AttentionPlans:
    """Per chunk: no mask for one token (it sees every row), is_causal from position 0, else an offset mask;
    and under `window`, over the window's rows only (sliding.window_mask)."""
    causal: list[bool] = []
    masks: dict[int, torch.Tensor] = {}
    window_causal: list[bool] = []
    window_masks: dict[int, torch.Tensor] = {}
    for i, (ch, n) in enumerate(zip(chunks, lengths, strict=True)):
        if n == 1:
            causal.append(False)
        elif ch.start == 0:
            causal.append(True)
        else:
            causal.append(False)
            rows = torch.arange(ch.start, ch.start + n).unsqueeze(1)
            masks[i] = torch.arange(ch.start + n).unsqueeze(0) <= rows
        if window is not None:
            mask = None if n == 1 else window_mask(ch.start, n, window)
            window_causal.append(n > 1 and mask is None)
            if mask is not None:
                window_masks[i] = mask
    return AttentionPlans(offsets, causal, masks, window_causal, window_masks)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query token against all rows: q [H, D], k/v [KVH, L, D] -> [H, D]. On CPU in float32 two small
    bmm calls beat SDPA's per-call overhead for a single query (softmax in the input dtype, so float32 only).
    `scale` multiplies the scores (None = 1/sqrt(D))."""
    kv_heads, d = k.shape[0], k.shape[2]
    grouped = q.view(kv_heads, -1, d) * (d**-0.5 if scale is None else scale)
    scores = torch.bmm(grouped, k.transpose(1, 2))
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(-1, d)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks` [H], with no value (gpt-oss), as transformers'
    eager gpt-oss attention computes it: scores, the sink appended, the row's maximum subtracted, softmax, the
    sink's column dropped. q [L, H, D], k/v [KVH, S, D], `mask` [L, S] (True: seen) or `causal` from key 0;
    returns [L, H, D]. Explicit, not SDPA: no fused kernel takes a sink; a long chunk runs in blocks of queries
    so that its scores stay within SINK_SCORES values."""
    n_q, heads, d = q.shape
    groups = heads // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    if mask is None and causal:
        mask = torch.ones(n_q, k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - n_q)
    scale = d**-0.5 if scale is None else scale
    rows = max(1, SINK_SCORES // (heads * k.shape[1]))
    out = [_sink_rows(q[a : a + rows], k, v, None if mask is None else mask[a : a + rows], scale, sinks)
           for a in range(0, n_q, rows)]
    return out[0] if len(out) == 1 else torch.cat(out)


SINK_SCORES = 1 << 26  # scores of one block of queries (256 MiB in float32)


def _sink_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               sinks: torch.Tensor) -> torch.Tensor:
    heads, n_q = q.shape[1], q.shape[0]
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, L, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat((scores, sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, n_q, 1)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch's SDPA for a chunk, q [1, H, L, D] against k/v [1, KVH, S, D], grouped heads expanded where this
    PyTorch's SDPA cannot take them (`enable_gqa`)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _HAS_GQA:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    kwargs: dict = {"enable_gqa": True} if groups > 1 and _HAS_GQA else {}
    if scale is not None:
        kwargs["scale"] = scale
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kwargs)
