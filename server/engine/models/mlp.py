"""The SwiGLU feed-forward with LoRA on gate, up and down as one autograd node: 2.2 (bf16) or 3.7 MB saved a layer.

Separate nodes save, per layer at T = 256 on SmolLM2: the input x (shared by gate/up), gate and up for the SwiGLU
backward and the SwiGLU output for down's dA, 5.3 MB in fp32. This node saves x, gate and up only and recomputes
``silu(gate)·up`` in the backward (one elementwise pass): 47 MB less per 256-token SmolLM2 step. Where gate and up
run as bf16 GEMMs it saves their bf16 products instead of the fp32 outputs and rebuilds the outputs from them in the
backward, bit for bit (``lora_group.rebuild``: widen, add the LoRA term again): 1.6 MB less per layer. Measured on
SmolLM2 at bf16, 30-step bench/train.py runs: peak RSS 1144 and 1135 MB before, 1106 and 1100 MB after, the same
losses to the last printed digit; the rebuild (two widenings, two rank-8 products a layer) made a step 1.01-1.025x
as long in interleaved pairs. (Rounding gate and up to bf16 instead would change the numbers.) Given the block's
RMSNorm, the node applies it itself and the x it saves is the norm's input, which the norm's backward needs anyway:
the normed rows are recomputed bit for bit (``lora_group.normed_rows``), 0.6 MB less per layer.

Where gate and up are bias-free torch bf16 GEMMs, their fp32 outputs never exist at all: one pass
(``fused.lora_swiglu_forward``) reads the bf16 products, adds each LoRA term ``s·h·Bᵀ`` a tile of rows at a time and
writes ``act`` (and its bf16 copy for down_proj); the backward's pass (``fused.lora_swiglu_backward``) rebuilds them
the same way and writes ``[d_gate | d_up]`` and ``act`` for down's dA, which is why d_act comes first
(``lora_group.backward_parts``). Per layer (T = 256, 2 threads, AMX Xeon) the forward's widen + two rank-8 updates +
SwiGLU took 320 µs, the pass 220; the backward's 510, the pass 350; a SmolLM2 step -2.5 ms (30 interleaved pairs).
Where gate's and up's weights are stacked, the backward's pass also takes their LoRA gradients
(``fused.lora_swiglu_backward_grads``): ``g = [d_gate·B_g | d_up·B_u]`` and each ``dB`` while a tile of 8 rows of
fp32 gradients is in cache, so ``[d_gate | d_up]`` never exists in fp32 (only its bf16 copy, the GEMM's operand) and
four thin MKL products a layer, each a pass over half of it, are gone (``lora_group.input_grad_from_rank_rows``). Per
layer (T = 256, 2 threads, AMX Xeon) the pass and those products took 664 µs, the new pass 522; a SmolLM2 step -12.0,
-2.7 and -10.4 ms (median of 14 steps, one process per commit, one fixed batch) and -5.4 and -1.5 ms (20 interleaved
pairs in one process, twice). That pass also takes down_proj's dA from the ``act`` rows it rebuilds (``act`` is never
written out) and the forward's pass takes down_proj's ``h = act·A_dᵀ`` as it writes ``act``: per SmolLM2 layer at 224
rows (Zen 5, 2 threads) the two passes, a thin MKL product and a ``lowrank_rows`` pass took 1.23 ms, the two passes
now 0.89.

Where the kernels are built and the node is its common case (gate/up stacked, down at bf16, no biases, the norm
inside), the whole composition above runs as one kernel call a direction (``fused.lora_mlp_forward``/``_backward``,
the same kernels and GEMMs in the same order, so the same bits): about 30 Python calls and 20 dispatches from Python
less per direction. Per SmolLM2 node at 224 rows (Zen 5, 2 threads, 30 alternations) 8.25 -> 7.94 ms forward +
backward; in a step of the auto plan, whose int8 layers keep the Python composition, -5.5 ms (median of 30 same-batch
pairs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lorad.kernels import LoRALinear
from lorad.kernels.fused import (
    lora_mlp_backward,
    lora_mlp_forward,
    lora_swiglu_backward,
    lora_swiglu_backward_grads,
    lora_swiglu_forward,
    swiglu_backward,
    swiglu_forward,
)
from lorad.kernels.lora import rows_fp32
from lorad.kernels.lora_group import (
    a_grads,
    backward_parts,
    bf16_products,
    finish_forward,
    forward_keeping_products,
    gemm_bias,
    groupable,
    input_grad_from_rank_rows,
    lora_bs,
    lora_rows,
    norm_input_grad,
    normed_rows,
    one_call_weight,
    rebuild,
    recompute_rows,
    rows_a_grads,
    stacked,
    submit_forward,
    takes_bf16_rows,
)
from lorad.kernels.lora_group import backward as group_backward
from lorad.kernels.rmsnorm import RMSNorm
from lorad.kernels.torch_backend import joint_bf16


def fusable(gate: LoRALinear, up: LoRALinear, down: LoRALinear) -> bool:
    """Whether the three layers may run as one node (see ``lora_group.groupable``)."""
    return groupable((gate, up)) and groupable((down,)) and down.scaling == gate.scaling


class _LoRASwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, layers: tuple[LoRALinear, LoRALinear, LoRALinear], norm: RMSNorm | None, x: Tensor, *params: Tensor
    ) -> Tensor:
        del params  # read from the layers (the same tensors), passed only so autograd tracks them
        gate_l, up_l, down_l = layers
        ctx.layers, ctx.norm, ctx.in_shape = layers, norm, x.shape
        weights = _one_call_weights(layers, norm, x)
        ctx.one_call = weights
        if weights is not None:  # the whole node in one kernel call a direction (fused.lora_mlp_forward)
            assert norm is not None
            x2d = x.reshape(-1, x.shape[-1])
            a_gu = torch.cat([gate_l.lora_A, up_l.lora_A]).detach()
            got = lora_mlp_forward(
                x2d, norm, weights[0], a_gu, lora_bs((gate_l, up_l)), weights[1], down_l.lora_A.detach(),
                down_l.lora_B.detach(), scaling=gate_l.scaling,
            )  # fmt: skip
            assert got is not None
            out, rstd, prod, h_gu, h_d = got
            ctx.save_for_backward(x2d, rstd, prod, h_gu, h_d, a_gu)
            return out.view(*x.shape[:-1], down_l.out_features)
        x2, x2b, saved = normed_rows(x, norm, gate_l.in_features, want_bf16=takes_bf16_rows((gate_l, up_l)))
        want_act_b = takes_bf16_rows((down_l,))
        prods = bf16_products((gate_l, up_l), x2, x2b)
        if prods is not None:  # gate and up stay bf16 products plus LoRA terms, never fp32 tensors
            h_gu = lora_rows((gate_l, up_l), x2)
            bs = lora_bs((gate_l, up_l))
            a_d = down_l.lora_A.detach()
            act, act_b, h_next = lora_swiglu_forward(
                prods, h_gu, bs, scaling=gate_l.scaling, want_bf16=want_act_b, a_next=a_d
            )
            kept = prods
        else:
            (gate, up), h_gu, kept = forward_keeping_products((gate_l, up_l), x2, x2b)
            act, act_b = swiglu_forward(gate, up, want_bf16=want_act_b)
            h_next = None
        (out,), h_d = finish_forward((down_l,), act, submit_forward((down_l,), act, act_b), h=h_next)
        ctx.save_for_backward(h_gu, h_d, *kept, *saved)
        ctx.kept = len(kept)
        ctx.products = prods is not None
        return out.reshape(*x.shape[:-1], down_l.out_features)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        gate_l, up_l, down_l = ctx.layers
        dout2 = rows_fp32(dout, down_l.out_features)
        need_x = ctx.needs_input_grad[2]
        if ctx.one_call is not None:
            w_gu, w_d = ctx.one_call
            dx, d_a_gu, d_b_g, d_b_u, d_a_d, d_b_d = lora_mlp_backward(
                dout2, ctx.saved_tensors, ctx.norm, w_gu, lora_bs((gate_l, up_l)), w_d, down_l.lora_A.detach(),
                down_l.lora_B.detach(), scaling=gate_l.scaling, need_x=need_x,
            )  # fmt: skip
            rg = gate_l.rank
            dx_in = None if dx is None else dx.view(ctx.in_shape)
            return None, None, dx_in, d_a_gu[:rg], d_a_gu[rg:], d_a_d, d_b_g, d_b_u, d_b_d
        h_gu, h_d, *rest = ctx.saved_tensors
        kept, saved = rest[: ctx.kept], rest[ctx.kept :]  # gate's and up's products (one when stacked); the norm's
        gu_stacked = stacked((gate_l, up_l))
        want_b = need_x and gu_stacked  # the stacked gate/up GEMM takes [d_gate | d_up] in bf16
        if ctx.products:
            # d_act first (it needs no act), then one pass: [d_gate | d_up], its bf16 copy and, from act, down's dA
            d_act, g_d, (d_b_d,) = backward_parts((down_l,), h_d, [dout2], need_x=True)
            assert d_act is not None
            bs = lora_bs((gate_l, up_l))
            # where the stacked gate/up GEMM takes [d_gate | d_up] in bf16, the pass also takes gate's and up's LoRA
            # gradients while each tile is in cache, and their fp32 gradients never exist
            grads = None
            if gu_stacked:
                grads = lora_swiglu_backward_grads(d_act, kept, h_gu, bs, g_d.t(), scaling=gate_l.scaling)
            if grads is not None:
                gu_bf16, d_a_d, g_rows, d_b_g, d_b_u = grads
                d_a_g, d_a_u = rows_a_grads((gate_l, up_l), ctx.norm, saved, g_rows.t())
                dx_gu = input_grad_from_rank_rows((gate_l, up_l), g_rows, gu_bf16) if need_x else None
                dx_in = None if dx_gu is None else norm_input_grad(ctx.norm, saved, dx_gu, ctx.in_shape)
                return None, None, dx_in, d_a_g, d_a_u, d_a_d, d_b_g, d_b_u, d_b_d
            d_gu, d_gu_b, act = lora_swiglu_backward(d_act, kept, h_gu, bs, scaling=gate_l.scaling, want_bf16=want_b)
            (d_a_d,) = a_grads((down_l,), g_d, act)
        else:
            gate, up = rebuild((gate_l, up_l), h_gu, kept)
            act, _ = swiglu_forward(gate, up)  # recomputed: cheaper than keeping [T, intermediate] fp32 per layer
            d_act, (d_a_d,), (d_b_d,) = group_backward((down_l,), act, h_d, [dout2], need_x=True)
            assert d_act is not None
            # [d_gate | d_up] in one pass, with their bf16 copy when the stacked gate/up GEMM takes it
            d_gu, d_gu_b = swiglu_backward(d_act, gate, up, want_bf16=want_b)
        f = gate_l.out_features
        x2 = recompute_rows(ctx.norm, saved, gate_l.in_features)
        dx, (d_a_g, d_a_u), (d_b_g, d_b_u) = group_backward(
            (gate_l, up_l), x2, h_gu, [d_gu[:, :f], d_gu[:, f:]], need_x=need_x, dys_bf16=d_gu_b
        )
        dx_in = None if dx is None else norm_input_grad(ctx.norm, saved, dx, ctx.in_shape)
        return None, None, dx_in, d_a_g, d_a_u, d_a_d, d_b_g, d_b_u, d_b_d


def _one_call_weights(
    layers: tuple[LoRALinear, LoRALinear, LoRALinear], norm: RMSNorm | None, x: Tensor
) -> tuple[Tensor, Tensor] | None:
    """(gate/up's stacked bf16 weight, down's bf16 weight) when the node runs as one kernel call a direction
    (``fused.lora_mlp_forward``): gate/up as ``lora_group.one_call_weight`` takes them (their widths and x's a
    multiple of 16), down at bf16 both ways, no biases. Else None: the Python composition below runs."""
    gate_l, up_l, down_l = layers
    w_gu = one_call_weight((gate_l, up_l), norm, x)
    w_d = joint_bf16([down_l.frozen])
    if w_gu is None or w_d is None or any(gemm_bias(m) is not None for m in layers):
        return None
    return (w_gu, w_d) if all(p.dtype == torch.float32 for p in (down_l.lora_A, down_l.lora_B)) else None


def lora_swiglu(gate: LoRALinear, up: LoRALinear, down: LoRALinear, x: Tensor, norm: RMSNorm | None = None) -> Tensor:
    """``down(silu(gate(x))·up(x))`` with every LoRA term, as one autograd node (``fusable`` must hold); with
    ``norm``, of ``rms_norm(x)``, the norm inside the node (it saves x, not the normed rows)."""
    params = (gate.lora_A, up.lora_A, down.lora_A, gate.lora_B, up.lora_B, down.lora_B)
    out: Tensor = _LoRASwiGLU.apply((gate, up, down), norm, x, *params)
    return out
