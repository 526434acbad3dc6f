"""LoRA linear on top of a FrozenLinear: the frozen product runs on the NpuQueue while the CPU does the LoRA terms."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lorad.kernels.frozen import FrozenLinear
from lorad.kernels.fused import lora_out_grads, lowrank_a_grads, lowrank_rows, widen_lowrank
from lorad.kernels.queue import NpuQueue, queue_for
from lorad.kernels.torch_backend import TorchFrozenLinear, bf16_gemm


def rows_fp32(t: Tensor, features: int) -> Tensor:
    """``t`` as a contiguous float32 [rows, features] matrix (a view when it already is one): what backends take."""
    t2 = t.reshape(-1, features)
    if t2.dtype != torch.float32:
        t2 = t2.float()
    return t2.contiguous()


class FrozenMatmul(torch.autograd.Function):
    """``y = frozen.forward(x)``; backward gives ``dX = frozen.input_grad(dY)`` and never a weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, frozen: FrozenLinear, queue: NpuQueue | None = None) -> Tensor:
        ctx.frozen = frozen
        ctx.queue = queue or queue_for(frozen)
        ctx.in_shape = x.shape
        x2 = rows_fp32(x, frozen.in_features)
        y: Tensor = ctx.queue.submit(frozen.forward, x2).result()
        return y.reshape(*x.shape[:-1], frozen.out_features)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dy2 = rows_fp32(dy, ctx.frozen.out_features)
        dx = ctx.queue.submit(ctx.frozen.input_grad, dy2).result()
        return dx.reshape(ctx.in_shape), None, None


class _LoRAFrozenFn(torch.autograd.Function):
    """Fused frozen + LoRA product so the NPU call and the CPU LoRA math overlap in both directions."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes positionals)
        ctx: Any,
        x: Tensor,
        lora_a: Tensor,
        lora_b: Tensor,
        frozen: FrozenLinear,
        queue: NpuQueue,
        scaling: float,
        dropout: float,
        training: bool,
    ) -> Tensor:
        rows = x.reshape(-1, frozen.in_features).contiguous()
        # Rows narrower than fp32 (the bf16 attention's output) go to a torch frozen product and to the LoRA kernels
        # (which widen a tile at a time) as they are, and are what is saved (widening them is exact); other backends
        # take fp32. A torch bf16 GEMM's product is widened below with the LoRA term added in the same pass.
        gemm = bf16_gemm(frozen)
        fut = None
        if gemm is None:
            fut = queue.submit(frozen.forward, rows if isinstance(frozen, TorchFrozenLinear) else rows.float())
        # CPU side while the frozen product runs: s·(drop(x)·Aᵀ)·Bᵀ.
        mask = None
        xd = rows
        if dropout > 0.0 and training:
            x2 = rows.float()
            mask = torch.empty_like(x2).bernoulli_(1.0 - dropout).div_(1.0 - dropout)
            xd = x2 * mask
        h = lowrank_rows(xd, lora_a)  # [T, r]
        if gemm is not None:
            y = widen_lowrank(gemm.bf16_product(rows), h, lora_b.t(), scaling=scaling, bias=gemm.bias)
        else:
            assert fut is not None
            y = fut.result().addmm_(h, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(rows if mask is None else xd, h, lora_a, lora_b, mask)
        ctx.frozen, ctx.queue, ctx.scaling = frozen, queue, scaling
        ctx.in_shape = x.shape
        return y.reshape(*x.shape[:-1], frozen.out_features)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        xd, h, lora_a, lora_b, mask = ctx.saved_tensors  # xd: the forward's fp32 rows, or the narrower ones it kept
        s = ctx.scaling
        dy2 = rows_fp32(dy, ctx.frozen.out_features)
        need_x = ctx.needs_input_grad[0]
        gemm = bf16_gemm(ctx.frozen, backward=True) if mask is None else None  # its product widened with the LoRA part
        fut = ctx.queue.submit(ctx.frozen.input_grad, dy2) if need_x and gemm is None else None  # queued first
        if mask is None:  # one pass over dy: g, dB and (for a bf16 GEMM) its bf16 operand
            fused = lora_out_grads([dy2], h, [lora_b], scaling=s, want_bf16=need_x and gemm is not None)
            if fused is not None:
                packed, g_rows, (d_b_rows,) = fused
                d_a_f = lowrank_a_grads(xd, g_rows, scaling=s) if ctx.needs_input_grad[1] else None
                dx_f = None
                if gemm is not None and packed is not None:
                    dx_f = widen_lowrank(gemm.input_grad_product(packed), g_rows, lora_a, scaling=s)
                elif fut is not None:  # another backend's (or precision's) input gradient, the LoRA part added to it
                    dx_f = fut.result().addmm_(g_rows, lora_a, alpha=s)
                dx_f = None if dx_f is None else dx_f.reshape(ctx.in_shape)
                d_b_f = d_b_rows if ctx.needs_input_grad[2] else None
                return dx_f, d_a_f, d_b_f, None, None, None, None, None
        g = (lora_b.t() @ dy2.t()).t()  # [T, r] as [r, out]·[out, T]: MKL runs [T, out]·[out, r] at 4-20x the time
        d_b = (h.t() @ dy2).t().mul_(s) if ctx.needs_input_grad[2] else None
        d_a = (g.t() @ xd.float()).mul_(s) if ctx.needs_input_grad[1] else None
        dx = None
        if need_x and gemm is not None:
            dx = widen_lowrank(gemm.input_grad_product(dy2), g, lora_a, scaling=s).reshape(ctx.in_shape)
        elif fut is not None:
            dx = fut.result()
            if mask is None:
                dx.addmm_(g, lora_a, alpha=s)  # the LoRA part added by the GEMM itself: no [T, in] temporary
            else:
                dx.add_((g @ lora_a).mul_(s).mul_(mask))
            dx = dx.reshape(ctx.in_shape)
        return dx, d_a, d_b, None, None, None, None, None


class LoRALinear(nn.Module):
    """``y = frozen(x) + scaling·(dropout(x)·Aᵀ)·Bᵀ`` with ``lora_A`` [rank, in] and ``lora_B`` [out, rank].

    ``rank=0`` means no adapter: the frozen product only, still differentiable w.r.t. x (the frozen lm_head).
    Init follows PEFT: A kaiming-uniform(a=√5), B zeros, scaling = alpha / rank.
    """

    def __init__(
        self, frozen: FrozenLinear, rank: int, alpha: float, dropout: float = 0.0, queue: NpuQueue | None = None
    ) -> None:
        super().__init__()
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.frozen = frozen
        self.in_features = frozen.in_features
        self.out_features = frozen.out_features
        self.rank = rank
        self.alpha = alpha
        self.dropout = dropout
        self.scaling = alpha / rank if rank > 0 else 0.0
        self._queue = queue  # None: resolved per call, so swapping .frozen (the planner does) picks its queue
        if rank > 0:
            self.lora_A = nn.Parameter(torch.empty(rank, self.in_features))
            self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        else:
            self.register_parameter("lora_A", None)
            self.register_parameter("lora_B", None)

    @property
    def queue(self) -> NpuQueue:
        """The queue this layer's frozen calls go through."""
        return self._queue or queue_for(self.frozen)

    def forward(self, x: Tensor) -> Tensor:
        q = self.queue
        if self.rank == 0:
            y: Tensor = FrozenMatmul.apply(x, self.frozen, q)  # type: ignore[no-untyped-call]  # torch's apply
            return y
        out: Tensor = _LoRAFrozenFn.apply(  # type: ignore[no-untyped-call]  # torch's apply is unannotated
            x, self.lora_A, self.lora_B, self.frozen, q, self.scaling, self.dropout, self.training
        )
        return out

    def extra_repr(self) -> str:
        f = self.frozen
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}, "
            f"precision={f.precision_fwd}/{f.precision_bwd}, name={f.name!r}"
        )
