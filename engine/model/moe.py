"""The sparse mixture-of-experts block that replaces a decoder layer's dense MLP in MoE families.

A router scores every expert for every token; each token runs its top-k experts and sums their outputs weighted
by the routing weights. Tokens are grouped by expert: each expert that any token chose runs once, as one
matmul over all the rows routed to it (a prefill of 1000 tokens makes at most n_experts expert calls, not
1000 * top_k). Qwen2-MoE adds a shared expert that every token runs, behind a sigmoid gate; GLM-4.x MoE one
without a gate, added as it is. gpt-oss biases its router and its experts, and clamps its SwiGLU (`clamped_mlp`).
Gemma 4's expert block sits beside its dense MLP (engine/model/gemma4_experts.py): it routes from its own norm of
the residual and runs GeGLU experts (`MoeConfig.activation`) through `SparseMoe.run_routed`, the part below that
knows where the experts live.

Numerics follow transformers exactly: the same routing ops on the same values in the same order (so ties
between equal router scores go the same way: torch.topk on the float32 probabilities over experts in index
order), and each token's expert outputs are summed in ascending expert order starting from zero, as
transformers' `index_add_` loop does. The projections go through projections.py's `linear`, so a row's result does
not depend on how many other rows an expert got (the batch invariance projections.py describes): a
slot's logits are the same alone and batched.

On a GPU by default (`fast`, i.e. not --deterministic; bfloat16 experts on an sm90 / sm100 device), the routed
experts run as two grouped GEMMs over all of them (`torch._grouped_mm`, PyTorch's CUTLASS kernel): the k rows
of every token are sorted by expert, each expert's slice of the sorted rows is one problem of the group, and
the per-expert offsets are computed on the device, so nothing is read back to the host and a decode step can
be captured in a CUDA graph (engine/model/graph_decode.py). Each token's terms are still summed in ascending
expert order from zero; only the GEMM kernel differs from the per-expert loop, so a row's last bits may depend
on what else the step holds, as with the dense layers' one-GEMM path. Elsewhere (the CPU, float32,
--deterministic, 4-bit experts, a PyTorch without the kernel) each chosen expert runs as its own pair of GEMMs.

Placement (`--moe-experts cpu`, `--moe-cpu-layers N`, engine/model/moe_placement.py): a layer's routed experts
may live on another device than the rest of the layer, in host RAM as 4-bit groups. The router and the shared
expert run where the layer runs; the routed rows go to the experts' device, run there, and come back summed. A
batch of many rows on a GPU (a prefill chunk) brings the experts to the rows instead (engine/model/moe_offload.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model import int4, moe_offload
from engine.model.kernels import RowsWeight
from engine.model.moe_config import MoeConfig
from engine.model.projections import linear

# An expert stack: float [n_experts, out, in], or one weight per expert (4-bit groups, or the file's Q4_K / Q6_K /
# Q8_0 rows, engine/model/kquant_weight.py).
Experts = torch.Tensor | list[int4.Int4Weight] | list[RowsWeight]


def route(logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, n_experts] -> (weights [tokens, k] float32, experts [tokens, k] int64); `bias`
    [n_experts] float32: what sigmoid_bias routing adds to the scores to choose (engine/model/moe_config.py)."""
    if moe.routing == "sigmoid_bias":
        scores = sigmoid_rows(logits.float())
        choice = scores if bias is None else scores + bias
        if moe.n_group > 1:
            choice = keep_top_groups(choice, moe.n_group, moe.topk_group)
        experts = torch.topk(choice, moe.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + moe.norm_eps)
        return weights * moe.routed_scaling, experts
    if moe.routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
    assert moe.routing == "topk_softmax", moe.routing
    top, experts = torch.topk(logits.float(), moe.top_k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def keep_top_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`choice` [tokens, n_experts] with every expert outside the best `topk_group` of `n_group` groups (of
    consecutive experts) set to -inf; a group ranks by the sum of its two best values (DeepSeek-V3's grouped
    routing, as transformers computes it for GLM-4.x MoE and Nemotron-H)."""
    tokens, n_experts = choice.shape
    grouped = choice.reshape(tokens, n_group, n_experts // n_group)  # a slice of padded sigmoids: not a view
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    keep = torch.zeros_like(group_scores)
    keep.scatter_(1, torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1], 1)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, n_experts)
    return choice.masked_fill(~mask.bool(), float("-inf"))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# MoeConfig.activation -> the gate's activation.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _mlp(x: torch.Tensor, gate_up, down, n_single: int, fast: bool = False, activation: str = "silu") -> torch.Tensor:
    """A gated MLP over fused [gate; up] rows: down(act(gate x) * up x), SwiGLU unless `activation` says."""
    gu = linear(x, gate_up, n_single, fast=fast)
    inter = gu.shape[1] // 2
    return linear(_ACTIVATIONS[activation](gu[:, :inter]) * gu[:, inter:], down, n_single, fast=fast)


def clamped_mlp(x: torch.Tensor, gate_up, down, n_single: int, gate_up_bias: torch.Tensor,
                down_bias: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert over fused [gate; up] rows with biases, as transformers' GptOssExperts computes it:
    gate <= limit, -limit <= up <= limit, down((up + 1) * gate * sigmoid(alpha * gate)) + down_bias."""
    gu = linear(x, gate_up, n_single, gate_up_bias.to(x.dtype))
    inter = gu.shape[1] // 2
    gate = gu[:, :inter].clamp(max=limit)
    up = gu[:, inter:].clamp(min=-limit, max=limit)
    return linear((up + 1) * (gate * torch.sigmoid(gate * alpha)), down, n_single, down_bias.to(x.dtype))


class SparseMoe(torch.nn.Module):
    """Router + experts (+ an optional shared expert, gated or not) of one layer.

    `gate_up` is [n_experts, 2 * expert_size, hidden] (each expert's gate rows, then its up rows), `down`
    [n_experts, hidden, expert_size]. After `quantize_experts` they are lists of int4.Int4Weight, one per expert;
    a loader that has the experts as 4-bit groups already (a Q4 GGUF's codes) passes such lists itself, or lists
    of kernels.RowsWeight (a GGUF's own Q4_K, Q6_K or Q8_0 blocks, engine/model/kquant_weight.py).
    With a gated shared expert (`MoeConfig.shared_gated`), `router` holds its gate as a last row.
    """

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # quantize_experts replaces the expert weights by Int4Weight ones.
    router: torch.Tensor
    expert_bias: torch.Tensor | None
    gate_up: Experts
    down: Experts
    shared_gate_up: torch.Tensor | int4.Int4Weight | None
    shared_down: torch.Tensor | int4.Int4Weight | None
    router_bias: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        *,
        router: torch.Tensor,
        gate_up: Experts,
        down: Experts,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        expert_bias: torch.Tensor | None = None,
        router_bias: torch.Tensor | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        e, inter, h = moe.n_experts, moe.expert_size, hidden_size
        assert router.shape == (e, h), ("router", tuple(router.shape))
        assert expert_bias is None or (moe.routing == "sigmoid_bias" and expert_bias.shape == (e,)
                                       and expert_bias.dtype == torch.float32), "expert_bias: [n_experts] float32"
        assert _shape(gate_up) == (e, 2 * inter, h), ("gate_up", _shape(gate_up))
        assert _shape(down) == (e, h, inter), ("down", _shape(down))
        has_shared = moe.shared_expert_size > 0
        gated = has_shared and moe.shared_gated
        assert has_shared == (shared_gate_up is not None) == (shared_down is not None), "shared expert weights"
        assert gated == (shared_gate is not None), f"shared expert gate: {'expected' if gated else 'unexpected'}"
        if has_shared:
            s = moe.shared_expert_size
            assert shared_gate_up is not None and shared_down is not None  # see above
            assert shared_gate_up.shape == (2 * s, h) and shared_down.shape == (h, s), "shared expert shape"
            assert shared_gate is None or shared_gate.shape == (1, h), ("shared_gate", tuple(shared_gate.shape))
        self.config = moe
        if gated:
            # The shared expert's gate is one more router row: one product for both, and a product with a
            # single output column sums differently by row count under BLAS (batch invariance).
            assert shared_gate is not None  # has_shared (asserted above)
            router = torch.cat((router, shared_gate))
        self.register_buffer("router", router, persistent=False)
        self.register_buffer("expert_bias", expert_bias, persistent=False)
        for name, w in (("gate_up", gate_up), ("down", down)):
            if isinstance(w, torch.Tensor):
                self.register_buffer(name, w, persistent=False)
            else:  # a module cannot register a list of Int4Weight as a buffer (as quantize_experts leaves it)
                object.__setattr__(self, name, w)
        self.register_buffer("shared_gate_up", shared_gate_up, persistent=False)
        self.register_buffer("shared_down", shared_down, persistent=False)
        # gpt-oss: the router's bias (on the layer's device) and the experts' biases (where the experts are).
        assert (router_bias is not None) == moe.router_bias and not (moe.router_bias and gated), "router bias"
        assert router_bias is None or router_bias.shape == (e,), ("router_bias", tuple(router_bias.shape))
        assert (gate_up_bias is not None) == (down_bias is not None) == moe.expert_biases, "expert biases"
        assert gate_up_bias is None or gate_up_bias.shape == (e, 2 * inter), ("gate_up_bias", tuple(gate_up_bias.shape))
        assert down_bias is None or down_bias.shape == (e, h), ("down_bias", tuple(down_bias.shape))
        assert moe.expert_biases or not moe.clamped_swiglu, "the clamped SwiGLU is gpt-oss's, with expert biases"
        self.register_buffer("router_bias", router_bias, persistent=False)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)

    def forward(self, h: torch.Tensor, n_single: int, *, fast: bool = False) -> torch.Tensor:
        """h [tokens, hidden] (the first `n_single` rows are one-token chunks) -> the block's output.

        `fast` (the CUDA default, `linear`'s): one GEMM over all rows for the router and the shared expert, and
        the routed experts as one grouped GEMM where `grouped_ready` says they can be."""
        logits = linear(h, self.router, n_single, self.router_bias, fast=fast)
        n_experts = self.config.n_experts
        weights, experts = route(logits[:, :n_experts], self.config, self.expert_bias)
        out = self.run_routed(h, experts, weights, n_single, fast=fast)
        if self.shared_gate_up is not None:
            shared = _mlp(h, self.shared_gate_up, self.shared_down, n_single, fast).to(h.dtype)  # 4-bit: float32
            if self.config.shared_gated:
                shared = _sigmoid_column(logits[:, n_experts:]) * shared
            out = out + shared
        return out

    def run_routed(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, n_single: int, *,
                   fast: bool = False) -> torch.Tensor:
        """The routed experts' weighted sum for h [tokens, hidden] routed to `experts` [tokens, k] with `weights`
        [tokens, k] (float32), in h's device and dtype, wherever the experts live (the router's part is the
        caller's: `forward`, or a block that routes from another input, Gemma 4's)."""
        if fast and self.grouped_ready:
            assert isinstance(self.gate_up, torch.Tensor) and isinstance(self.down, torch.Tensor)  # grouped_ready
            return grouped_mm_experts(h, experts, weights.to(h.dtype), self.gate_up, self.down, self.config.activation)
        if fast and self.offload_rows(h):
            return self._routed_here(h, experts, weights.to(h.dtype), n_single)
        # Experts run where their weights are (host RAM beside a GPU) and in the dtype their products give
        # (float32 for the 4- and 8-bit kinds, whatever the layer's dtype): the hidden states and the routing
        # go to them, their weighted sum comes back in the layer's device and dtype.
        where, dtype = self.expert_device, self.expert_dtype
        out = self._routed(h.to(where, dtype), experts.to(where), weights.to(where, dtype), n_single)
        return out.to(h.device, h.dtype)

    def _routed(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, n_single: int) -> torch.Tensor:
        c = self.config
        if self.gate_up_bias is not None:  # gpt-oss
            gate_up_bias, down_bias = self.gate_up_bias, self.down_bias
            assert down_bias is not None and c.swiglu_limit is not None and c.swiglu_alpha is not None  # __init__
            limit, alpha = c.swiglu_limit, c.swiglu_alpha
            return grouped_experts(h, experts, weights, n_single, c.n_experts,
                                   lambda x, e, n_one: clamped_mlp(x, self.gate_up[e], self.down[e], n_one,
                                                                   gate_up_bias[e], down_bias[e], limit, alpha))
        return grouped_experts(h, experts, weights, n_single, c.n_experts,
                               lambda x, e, n_one: _mlp(x, self.gate_up[e], self.down[e], n_one,
                                                        activation=c.activation))

    def offload_rows(self, h: torch.Tensor) -> bool:
        """Whether the step's `h` is a batch big enough to bring experts kept in host RAM to h's GPU for it
        (engine/model/moe_offload.py)."""
        return (h.device.type == "cuda" and h.shape[0] >= moe_offload.OFFLOAD_MIN_ROWS
                and self.expert_device.type == "cpu" and moe_offload.offloadable(self.gate_up, self.down))

    def _routed_here(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     n_single: int) -> torch.Tensor:
        assert isinstance(self.gate_up, list) and isinstance(self.down, list)  # offload_rows: the file's blocks
        here = moe_offload.DeviceExperts(self.gate_up, self.down, h.device, h.dtype)

        def run(x: torch.Tensor, e: int, n_one: int) -> torch.Tensor:
            gate_up, down = here.weights(e)
            return _mlp(x, gate_up, down, n_one, fast=True, activation=self.config.activation)

        return grouped_experts(h, experts, weights, n_single, self.config.n_experts, run)

    @property
    def grouped_ready(self) -> bool:
        """Whether the routed experts can run as grouped GEMMs with no host synchronisation: float experts on
        the layer's device that `grouped_mm_usable` accepts."""
        if not isinstance(self.gate_up, torch.Tensor) or not isinstance(self.down, torch.Tensor):
            return False
        if self.gate_up_bias is not None:  # the grouped GEMMs add no expert biases (gpt-oss)
            return False
        return self.router.device == self.gate_up.device and grouped_mm_usable(self.gate_up, self.down)

    @property
    def expert_device(self) -> torch.device:
        """Where the routed experts' weights are (and so where they run)."""
        w = self.gate_up[0] if isinstance(self.gate_up, list) else self.gate_up
        return torch.device(w.device)

    @property
    def expert_dtype(self) -> torch.dtype:
        """The dtype the routed experts compute in: their own for float stacks, float32 for 4- and 8-bit ones."""
        return self.gate_up.dtype if isinstance(self.gate_up, torch.Tensor) else torch.float32

    @property
    def expert_bytes(self) -> int:
        """Bytes the routed experts' weights occupy (what llama.cpp's --n-cpu-moe moves to host RAM)."""
        return sum(_nbytes(w) for w in (self.gate_up, self.down))

    def quantize_experts(self, *, shared: bool = True) -> tuple[int, int]:
        """Experts (and with `shared` the shared expert) as 4-bit groups through int4.Int4Weight, one per expert
        and matrix (weights on the CPU only); returns (bytes before, after). The router (with the shared expert's
        gate) stays in float: it is small, and routing decides which experts run at all. A matrix whose shape
        the packing kernel does not take stays in float."""
        before = after = 0
        names = ("gate_up", "down", "shared_gate_up", "shared_down") if shared else ("gate_up", "down")
        for name in names:
            w = getattr(self, name)
            if not isinstance(w, torch.Tensor):
                continue
            stacked = w.dim() == 3
            if not int4.can_quantize(w[0] if stacked else w):
                continue
            packed = [int4.Int4Weight(w[e]) for e in range(w.shape[0])] if stacked else int4.Int4Weight(w)
            before += w.nbytes
            after += _nbytes(packed)
            self._buffers.pop(name, None)
            object.__setattr__(self, name, packed)
        return before, after


def grouped_experts(
    h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, n_single: int, n_experts: int,
    run: Callable[[torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:
    """Row t: the sum over k of weights[t, k] times expert experts[t, k] on it. Each chosen expert runs once on all
    its rows (`run(rows, expert, n_one)`, the first `n_one` rows one-token chunks); a row's terms are summed in
    ascending expert order from zero, as transformers' `index_add_` loop does."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    # Sorted by expert, and within an expert by token (a stable sort of token-major entries).
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    singles = torch.bincount(flat[: n_single * k], minlength=n_experts).tolist() if n_single else None
    tokens = order // k
    row_weights = weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start : start + n]
        n_one = singles[e] if singles else 0
        x = h.index_select(0, rows)
        # BLAS GEMMs run rows in blocks of 4 and the rows of a last, partial block through another kernel
        # (other sums); an expert's row count changes with what is batched, so it is padded to whole blocks.
        pad = -(n - n_one) % _ROW_BLOCK
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        y = run(x, e, n_one)[:n]
        out.index_add_(0, rows, y * row_weights[start : start + n])
        start += n
    return out


def grouped_mm_usable(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether expert stacks gate_up [E, 2I, H] and down [E, H, I] run through `torch._grouped_mm`'s own CUDA
    kernel: bfloat16 on an sm90 or sm100 device (elsewhere PyTorch falls back to a loop that reads the offsets
    back to the host, no better than ours), with 16-byte aligned data and rows of whole 16-byte vectors (the
    kernel's checks)."""
    if not hasattr(torch, "_grouped_mm") or gate_up.device.type != "cuda":
        return False
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16 or down.device != gate_up.device:
        return False
    if torch.cuda.get_device_capability(gate_up.device) not in _GROUPED_MM_CAPABILITIES:
        return False
    aligned = all(w.data_ptr() % 16 == 0 for w in (gate_up, down))
    return aligned and all(n % 8 == 0 for n in (*gate_up.shape[1:], *down.shape[1:]))


def grouped_mm_experts(
    h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`grouped_experts`' result (up to the GEMM kernel's rounding) as two grouped GEMMs over all experts.

    h [tokens, hidden], experts [tokens, k], weights [tokens, k] (h's dtype), gate_up [E, 2I, hidden], down
    [E, hidden, I]. The token-major (token, expert) entries are sorted by expert (stably, so by token within an
    expert); offsets[e] is the end of expert e's rows, found by a search in the sorted ids on the device. No
    value goes to the host and every shape depends on the row count alone: capturable in a CUDA graph. Each
    token's k terms are summed in ascending expert order from zero, as the per-expert loop sums them."""
    tokens, k = experts.shape
    n_experts = gate_up.shape[0]
    experts, pick = experts.sort(dim=1)  # a token's terms in ascending expert order
    weights = weights.gather(1, pick)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ids = torch.arange(n_experts, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], ids, right=True, out_int32=True)
    x = h.index_select(0, order // k)
    gu = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offsets)
    inter = gu.shape[1] // 2
    y = torch._grouped_mm(_ACTIVATIONS[activation](gu[:, :inter]) * gu[:, inter:], down.transpose(1, 2), offs=offsets)
    terms = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, -1) * weights.unsqueeze(2)
    out = terms[:, 0]
    for j in range(1, k):  # one add at a time in h's dtype, as index_add_ accumulates expert by expert
        out = out + terms[:, j]
    return out


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of [tokens, n] row by row the same whatever the number of rows: CPU kernels run the elements past
    the last whole vector through a scalar sigmoid (another last bit), so each row is padded to whole vectors."""
    n = x.shape[1]
    pad = -n % _SIMD_FLOATS
    if not pad:
        return torch.sigmoid(x)
    return torch.sigmoid(F.pad(x, (0, pad)))[:, :n]


def _sigmoid_column(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [tokens, 1] column, the same for a row whatever the number of rows: CPU kernels compute the
    elements past the last whole vector with a scalar sigmoid that differs from the vector one in the last bit,
    so the column is widened to whole vectors first."""
    return torch.sigmoid(x.expand(-1, _SIMD_FLOATS).contiguous())[:, :1]


# The devices PyTorch runs `_grouped_mm` on with its CUTLASS kernel (its fast path: sm90 and sm100, bfloat16).
_GROUPED_MM_CAPABILITIES = ((9, 0), (10, 0))
_ROW_BLOCK = 4  # the row blocking of MKL's float GEMM (the multi-row part of an expert's rows is padded to it)
_SIMD_FLOATS = 64  # a multiple of every CPU vector loop's step (2 x 16 floats with AVX-512)


def _shape(w: Experts) -> tuple[int, ...]:
    """An expert stack's [n_experts, out, in], whether a tensor or one Int4Weight per expert (all alike)."""
    if isinstance(w, torch.Tensor):
        return tuple(w.shape)
    assert w and all(x.shape == w[0].shape for x in w), [x.shape for x in w]
    return (len(w), *w[0].shape)


def _nbytes(w) -> int:
    return sum(p.nbytes for p in w) if isinstance(w, list) else w.nbytes
