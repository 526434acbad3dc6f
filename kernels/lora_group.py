"""LoRA layers that read one input (q/k/v; gate/up) as one autograd node: one stacked A product, one summed dX.

Per layer, ``y_i = frozen_i(x) + s·(x·A_iᵀ)·B_iᵀ`` exactly as ``LoRALinear``; what changes is the bookkeeping. Three
separate layers cost, per step and block, three ``[r, in]·[in, T]`` products where one ``[Σr, in]·[in, T]`` does, the
same for ``dA`` and the LoRA part of ``dX``, and autograd sums three ``dX`` tensors of the shared input. With the
MLP node (server/engine/models/mlp.py) a SmolLM2 step makes 1,070 instead of 1,427 GEMM calls (torch profiler) and
has 150 fewer autograd nodes. The frozen products of all members are submitted before the CPU LoRA math starts, so
on an NPU backend they queue back to back while the CPU works; torch bf16 members whose weights the builder stacked
(``torch_backend.stack_bf16``) run one GEMM per direction instead.

Only for members without dropout (or not training) and with one scaling; ``groupable`` says when. Given the RMSNorm
before them, the q/k/v node (and the MLP node) normalise their input themselves and keep the norm's input instead of
the normed rows (``normed_rows``): the same numbers, one [T, in] fp32 tensor less saved per node, peak RSS of a SmolLM2
bf16 run 915 -> 879 MB under tcmalloc (two pairs of 25-step runs), the step time unchanged within the noise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from lorad.kernels.fused import (
    SMALL_ROWS,
    kernels,
    lora_group_backward,
    lora_group_forward,
    lora_out_grads,
    lowrank_rows,
    rms_norm_a_grads,
    small_rows_bf16,
    widen_lowrank,
)
from lorad.kernels.lora import LoRALinear, rows_fp32
from lorad.kernels.rmsnorm import RMSNorm, rms_apply, rms_backward, rms_forward
from lorad.kernels.torch_backend import TorchFrozenLinear, bf16_gemm, joint_bf16, joint_input_grad_product


def groupable(members: Sequence[LoRALinear]) -> bool:
    """Whether these layers (same input) may run as one node: all adapted, one scaling, no active dropout, no
    module hooks (the planner's exact mode hooks single layers)."""
    if not members or any(m.rank == 0 for m in members):
        return False
    if len({m.scaling for m in members}) != 1 or len({m.in_features for m in members}) != 1:
        return False
    if any(m.dropout > 0.0 and m.training for m in members):
        return False
    return not any(m._forward_pre_hooks or m._forward_hooks for m in members)


def submit_forward(
    members: Sequence[LoRALinear], x2: Tensor, x2_bf16: Tensor | None = None
) -> Sequence[Future[Tensor] | Tensor]:
    """Every member's frozen forward on ``x2`` [T, in] (fp32), in member order: the future of its output (queued
    first, so an NPU works while the CPU goes on), or, where it is a torch bf16 GEMM, its bf16 product (column blocks
    of one product when the members' weights are stacked, ``torch_backend.joint_bf16``), of ``x2_bf16`` when given
    (the same rows rounded, as the fused norm and SwiGLU write them). ``finish_forward`` turns either into the
    outputs."""
    joint = _joint(members)
    if joint is not None:
        return _column_blocks(members, _joint_product(joint, x2, x2_bf16))
    gemms = [_bf16_gemm(m) for m in members]
    futs = {i: m.queue.submit(m.frozen.forward, x2) for i, m in enumerate(members) if gemms[i] is None}
    rows = x2 if x2_bf16 is None else x2_bf16
    return [futs[i] if g is None else g.bf16_product(rows) for i, g in enumerate(gemms)]


def takes_bf16_rows(members: Sequence[LoRALinear]) -> bool:
    """Whether these members' frozen forward multiplies bf16 rows (stacked, or each a torch bf16 GEMM): then whatever
    produces their input can write the bf16 copy in its own pass (``submit_forward``'s ``x2_bf16``)."""
    return stacked(members) or all(_bf16_gemm(m) is not None for m in members)


def stacked(members: Sequence[LoRALinear]) -> bool:
    """Whether the members' bf16 weights are stacked (one GEMM a direction; ``torch_backend.stack_bf16``), a single
    member at bf16 both ways counting as a group of one (``torch_backend.joint_bf16``)."""
    return _joint(members) is not None


def _joint(members: Sequence[LoRALinear]) -> Tensor | None:
    return joint_bf16([m.frozen for m in members])


def _joint_product(joint: Tensor, x2: Tensor, x2_bf16: Tensor | None = None) -> Tensor:
    """Every member's bf16 product side by side [T, Σout]: ``x2`` converted to bf16 once (or given so), one GEMM."""
    rows = x2 if x2_bf16 is None else x2_bf16
    small = small_rows_bf16(rows, joint)  # a generated token's row (fused.SMALL_ROWS)
    return small if small is not None else torch.mm(rows.to(torch.bfloat16), joint.t())


def finish_forward(
    members: Sequence[LoRALinear], x2: Tensor, frozen: Sequence[Future[Tensor] | Tensor], *, h: Tensor | None = None
) -> tuple[list[Tensor], Tensor]:
    """Each member's ``frozen(x) + s·(x·A_iᵀ)·B_iᵀ`` [T, out_i] and the stacked ``h = x·[A_1; …]ᵀ`` [T, Σr].

    ``frozen`` holds each member's frozen output or the future of it, or its bf16 product (``submit_forward``), which
    ``_add_lora`` widens with the LoRA term in one pass. ``h``, when the pass that wrote ``x2`` also took it
    (``fused.lora_swiglu_forward``), is used as it is.
    """
    if h is None:
        h = lora_rows(members, x2)
    ys = [
        _add_lora(m, f.result() if isinstance(f, Future) else f, h, o)
        for m, f, o in zip(members, frozen, _offsets(members), strict=True)
    ]
    return ys, h


def lora_rows(members: Sequence[LoRALinear], x2: Tensor) -> Tensor:
    """The stacked ``h = x·[A_1; …]ᵀ`` [T, Σr] of rows ``x2`` [T, in] (``fused.lowrank_rows``)."""
    return lowrank_rows(x2, _stacked_a(members))


def lora_bs(members: Sequence[LoRALinear]) -> list[Tensor]:
    """Each member's ``lora_B``, detached: what the kernels take."""
    return [m.lora_B.detach() for m in members]


def _stacked_a(members: Sequence[LoRALinear]) -> Tensor:
    """``[A_1; …]`` [Σr, in] (detached): a new tensor for several members, the one member's A itself (no copy)."""
    if len(members) == 1:
        return members[0].lora_A.detach()
    return torch.cat([m.lora_A for m in members]).detach()


def bf16_products(members: Sequence[LoRALinear], x2: Tensor, x2_bf16: Tensor | None = None) -> list[Tensor] | None:
    """Each member's frozen product ``x·W_iᵀ`` [T, out_i] as the bf16 GEMM returns it (column blocks of one product
    when the weights are stacked), or None unless every member's forward is a bias-free torch bf16 GEMM: then the
    member's output is ``float(product) + s·h_i·B_iᵀ``, which a consumer may compute in its own pass
    (``kernels.fused.lora_swiglu_forward``) instead of widening and updating [T, out_i] fp32 tensors."""
    gemms = [_bf16_gemm(m) for m in members]
    if not all(g is not None and g.bias is None for g in gemms):
        return None
    joint = _joint(members)
    if joint is not None:
        return _column_blocks(members, _joint_product(joint, x2, x2_bf16))
    rows = x2 if x2_bf16 is None else x2_bf16
    return [g.bf16_product(rows) for g in gemms if g is not None]


def _column_blocks(members: Sequence[LoRALinear], prod: Tensor) -> list[Tensor]:
    """Each member's columns of a product of the members side by side (views)."""
    starts = itertools.accumulate((m.out_features for m in members[:-1]), initial=0)
    return [prod[:, o : o + m.out_features] for m, o in zip(members, starts, strict=True)]


def forward_keeping_products(
    members: Sequence[LoRALinear], x2: Tensor, x2_bf16: Tensor | None = None
) -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """``finish_forward``'s outputs and ``h``, plus per member what to save so that ``rebuild`` gives its output back
    (``x2_bf16``: the rows already in bf16, as in ``submit_forward``).

    A member whose frozen product is a bf16 GEMM (torch at bf16) keeps that bf16 product, half the bytes of its fp32
    output; any other member keeps the output itself. Members with stacked weights keep their joint product, one
    tensor for all.
    """
    joint = _joint(members)
    if joint is not None:
        prod = _joint_product(joint, x2, x2_bf16)
        ys, h = finish_forward(members, x2, _column_blocks(members, prod))
        return ys, h, [prod]
    frozen = submit_forward(members, x2, x2_bf16)
    ys, h = finish_forward(members, x2, frozen)
    return ys, h, [y if isinstance(f, Future) else f for y, f in zip(ys, frozen, strict=True)]


def rebuild(members: Sequence[LoRALinear], h: Tensor, kept: Sequence[Tensor]) -> list[Tensor]:
    """The outputs ``forward_keeping_products`` returned, bit for bit: the same ops on the same operands (the
    adapters do not change between a forward and its backward)."""
    if _joint(members) is not None:
        blocks = _column_blocks(members, kept[0])
        return [_add_lora(m, p, h, o) for m, p, o in zip(members, blocks, _offsets(members), strict=True)]
    out: list[Tensor] = []
    for m, k, o in zip(members, kept, _offsets(members), strict=True):
        out.append(k if _bf16_gemm(m) is None else _add_lora(m, k, h, o))
    return out


def _bf16_gemm(m: LoRALinear) -> TorchFrozenLinear | None:
    """``m``'s frozen layer when its forward is a torch bf16 GEMM (whose bf16 product can be kept), else None."""
    return bf16_gemm(m.frozen)


def gemm_bias(m: LoRALinear) -> Tensor | None:
    """The bias of ``m``'s frozen torch bf16 GEMM (None without one, or where the forward is another product)."""
    g = _bf16_gemm(m)
    return None if g is None else g.bias


def _offsets(members: Sequence[LoRALinear]) -> list[int]:
    """Each member's first column in the stacked ``h``."""
    return list(itertools.accumulate((m.rank for m in members[:-1]), initial=0))


def _add_lora(m: LoRALinear, y: Tensor, h: Tensor, o: int) -> Tensor:
    """Member ``m``'s output from its frozen result ``y`` and the LoRA term ``s·h[:, o:o+r]·Bᵀ``: ``y`` is its fp32
    output (the term added in place) or, where the forward is a torch bf16 GEMM, that GEMM's bf16 product (widened,
    the bias and the term added in one pass: ``fused.widen_lowrank``)."""
    hm, bt = h[:, o : o + m.rank], m.lora_B.detach().t()
    if y.dtype == torch.bfloat16:
        g = _bf16_gemm(m)
        assert g is not None, f"{m.frozen.name}: a bf16 result from a layer whose forward is no bf16 GEMM"
        return widen_lowrank(y, hm, bt, scaling=m.scaling, bias=g.bias)
    return y.addmm_(hm, bt, alpha=m.scaling)


def backward(
    members: Sequence[LoRALinear],
    x2: Tensor,
    h: Tensor,
    dys: Sequence[Tensor],
    *,
    need_x: bool,
    dys_bf16: Tensor | None = None,
) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """(dX [T, in] or None, [dA_i], [dB_i]) for output gradients ``dys`` [T, out_i] (fp32, contiguous columns).

    ``backward_parts`` and then ``a_grads``: dX sums every member's frozen input gradient and one ``[T, Σr]·[Σr, in]``
    LoRA term; dA comes from one ``[Σr, T]·[T, in]`` product. ``dys_bf16``, the output gradients already side by side
    in bf16 [T, Σout] (the fused SwiGLU backward writes them), is what the stacked members' input-gradient GEMM then
    takes as it is.
    """
    dx, g, d_b = backward_parts(members, h, dys, need_x=need_x, dys_bf16=dys_bf16)
    return dx, a_grads(members, g, x2), d_b


def backward_parts(
    members: Sequence[LoRALinear],
    h: Tensor,
    dys: Sequence[Tensor],
    *,
    need_x: bool,
    dys_bf16: Tensor | None = None,
) -> tuple[Tensor | None, Tensor, list[Tensor]]:
    """``backward`` without the input rows: (dX or None, ``g`` = [Σr, T] whose row block i is ``(dy_i·B_i)ᵀ``,
    [dB_i]); ``a_grads(members, g, x2)`` gives dA. For a node whose input rows are only known after dX (the MLP's
    ``act``, recomputed by the pass that also takes d_act). The frozen input gradients are queued first, so an NPU
    computes them while the CPU does the rest. Where the kernels take the widths, one pass over each dy
    (``fused.lora_out_grads``) gives g, dB and, where the members' input gradient is one stacked bf16 GEMM, its bf16
    operand, instead of two thin MKL products per member, each a pass over dy, and a conversion: a SmolLM2 step -9.6,
    -9.5 and -9.1 ms with the same pass in ``lora._LoRAFrozenFn`` (one process per commit, one fixed batch, 14 steps
    each), -7.4 ms in 20 interleaved pairs in one process. Members whose input gradients are other backends' calls
    (an int8 down_proj, gate and up at int8) take the same pass for g and dB."""
    s = members[0].scaling
    joint = _joint(members) if need_x else None
    futs = []
    if need_x and joint is None:
        # contiguous for backends that hand the rows to a runtime (column blocks of [d_gate | d_up] are not)
        futs = [m.queue.submit(m.frozen.input_grad, dy.contiguous()) for m, dy in zip(members, dys, strict=True)]
    # one pass over each dy gives g, dB and (for a stacked bf16 GEMM) its bf16 operand
    bs = lora_bs(members)
    fused = lora_out_grads(dys, h, bs, scaling=s, want_bf16=joint is not None and dys_bf16 is None)
    if fused is not None:
        packed, g_rows, d_bs = fused
        dx_f = None
        if joint is not None:
            prod = joint_input_grad_product(joint, dys, packed=packed if dys_bf16 is None else dys_bf16)
            dx_f = widen_lowrank(prod, g_rows, _stacked_a(members), scaling=s)
        elif need_x:
            dx_f = _summed(futs).addmm_(g_rows, _stacked_a(members), alpha=s)
        return dx_f, g_rows.t(), d_bs
    total_r = sum(m.rank for m in members)
    g = torch.empty(total_r, h.shape[0], dtype=torch.float32)  # [Σr, T]: row block i is (dy_i·B_i)ᵀ
    d_b: list[Tensor] = []
    for m, dy, o in zip(members, dys, _offsets(members), strict=True):
        torch.mm(m.lora_B.detach().t(), dy.t(), out=g[o : o + m.rank])
        d_b.append((h[:, o : o + m.rank].t() @ dy).t().mul_(s))
    dx = None
    if need_x:
        a_cat = _stacked_a(members)
        if joint is not None:  # the LoRA part added as the product is widened: no separate pass over dX
            dx = widen_lowrank(joint_input_grad_product(joint, dys, packed=dys_bf16), g.t(), a_cat, scaling=s)
        else:
            dx = _summed(futs).addmm_(g.t(), a_cat, alpha=s)
    return dx, g, d_b


def _summed(futs: Sequence[Future[Tensor]]) -> Tensor:
    """The sum of the members' frozen input gradients, into the first one's tensor."""
    dx = futs[0].result()
    for fut in futs[1:]:
        dx.add_(fut.result())
    return dx


def input_grad_from_rank_rows(members: Sequence[LoRALinear], g_rows: Tensor, dys_bf16: Tensor) -> Tensor:
    """dX of stacked members (``stacked``) whose rank-space gradient ``g_rows`` [T, Σr], row t holding every
    ``dy_i[t]·B_i`` side by side, and dB the caller's own pass already took, with their output gradients side by side
    in bf16 ``dys_bf16`` [T, Σout] (``fused.lora_swiglu_backward_grads``): ``backward``'s dX without its thin products
    over the fp32 output gradients; ``rows_a_grads`` gives dA."""
    joint = _joint(members)
    assert joint is not None, f"{members[0].frozen.name}: its group is not stacked"
    prod = joint_input_grad_product(joint, (), packed=dys_bf16)
    return widen_lowrank(prod, g_rows, _stacked_a(members), scaling=members[0].scaling)


def rows_a_grads(
    members: Sequence[LoRALinear], norm: RMSNorm | None, saved: Sequence[Tensor], g: Tensor
) -> list[Tensor]:
    """``a_grads(members, g, recompute_rows(norm, saved, in))``: given the node's norm, the normed rows are recomputed a
    tile at a time inside the pass that sums dA (``fused.rms_norm_a_grads``) instead of as a [T, in] copy a thin
    product reads again; the same numbers up to the order of the sums."""
    features = members[0].in_features
    if norm is not None:
        x, rstd = saved
        x2d, r2d = x.reshape(-1, features), rstd.reshape(-1, 1)
        d_a_cat = rms_norm_a_grads(x2d, r2d, norm[0], g.t(), scaling=members[0].scaling)
        if d_a_cat is not None:
            return [d_a_cat[o : o + m.rank] for m, o in zip(members, _offsets(members), strict=True)]
    return a_grads(members, g, recompute_rows(norm, saved, features))


def a_grads(members: Sequence[LoRALinear], g: Tensor, x2: Tensor) -> list[Tensor]:
    """[dA_i] from ``backward_parts``' ``g`` and the node's input rows ``x2`` [T, in]: one ``[Σr, T]·[T, in]``."""
    d_a_cat = (g @ x2).mul_(members[0].scaling)  # [Σr, in]
    return [d_a_cat[o : o + m.rank] for m, o in zip(members, _offsets(members), strict=True)]


def normed_rows(
    x: Tensor, norm: RMSNorm | None, features: int, *, want_bf16: bool = False
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """The [T, features] fp32 rows a node multiplies (``x``, or ``x`` RMS-normed when ``norm`` is given), the same
    rows in bf16 when ``want_bf16`` and the norm writes them in its pass (else None), and what the node saves to get
    the rows back in the backward (``recompute_rows``): the rows themselves, or the norm's input and ``rstd``, which
    the norm's backward needs anyway (one [T, features] tensor per layer instead of two)."""
    if norm is None:
        x2 = rows_fp32(x, features)
        return x2, None, (x2,)
    y, rstd, yb = rms_forward(x, *norm, want_bf16=want_bf16)
    return rows_fp32(y, features), None if yb is None else yb.reshape(-1, features), (x, rstd)


def recompute_rows(norm: RMSNorm | None, saved: Sequence[Tensor], features: int) -> Tensor:
    """``normed_rows``' rows again from what it saved, bit for bit (the same ops on the same operands)."""
    if norm is None:
        return saved[0]
    x, rstd = saved
    return rows_fp32(rms_apply(x, rstd, norm[0]), features)


def norm_input_grad(norm: RMSNorm | None, saved: Sequence[Tensor], dx2: Tensor, shape: torch.Size) -> Tensor:
    """dL/d(the node's input) from dL/d(its rows) ``dx2``: through the RMSNorm's backward when it normed its input."""
    if norm is None:
        return dx2.reshape(shape)
    x, rstd = saved
    return rms_backward(dx2.reshape(shape), x, rstd, norm[0])


def one_call_weight(members: Sequence[LoRALinear], norm: RMSNorm | None, x: Tensor) -> Tensor | None:
    """The members' stacked bf16 weight when the kernels can run them, with the block's norm before them, in one call
    a direction (``fused.lora_group_forward``, and the MLP node's ``fused.lora_mlp_forward`` for gate/up): the kernels
    built, ``norm`` given, float32 rows ``x`` (contiguous, more than ``fused.SMALL_ROWS``), every width a multiple of
    16, float32 adapters. Else None: the Python composition runs."""
    if norm is None or x.dtype != torch.float32 or not x.is_contiguous() or x.numel() <= SMALL_ROWS * x.shape[-1]:
        return None
    w = _joint(members)
    if w is None or x.shape[-1] % 16 or any(m.out_features % 16 for m in members):
        return None
    if norm[0].dtype != torch.float32 or any(p.dtype != torch.float32 for m in members for p in (m.lora_A, m.lora_B)):
        return None
    return w if kernels() is not None else None


class _SharedInputFn(torch.autograd.Function):
    """Autograd node of ``shared_input_lora``; parameters come in as ``*A_i, *B_i`` so their gradients flow.

    Where ``one_call_weight`` holds, each direction is one kernel call (``fused.lora_group_forward``/``_backward``)
    running this composition's kernels and GEMMs in its order (the same bits) without its Python: a SmolLM2 q/k/v node
    at 224 rows (Zen 5, 2 threads) 2.27 -> 2.12 ms forward + backward; a step of the auto plan -3.1 ms (median of 30
    same-batch pairs)."""

    @staticmethod
    def forward(
        ctx: Any, members: tuple[LoRALinear, ...], norm: RMSNorm | None, x: Tensor, *params: Tensor
    ) -> tuple[Tensor, ...]:
        del params  # read from the members (the same tensors), passed only so autograd tracks them
        ctx.members, ctx.norm, ctx.in_shape = members, norm, x.shape
        ctx.one_call = one_call_weight(members, norm, x)
        if ctx.one_call is not None:
            assert norm is not None
            x2d = x.reshape(-1, x.shape[-1])
            a = _stacked_a(members)
            biases = [gemm_bias(m) for m in members]
            got = lora_group_forward(x2d, norm, ctx.one_call, a, lora_bs(members), biases, scaling=members[0].scaling)
            assert got is not None
            outs, rstd, h = got
            ctx.save_for_backward(x2d, rstd, h, a)
            return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in outs)
        x2, x2b, saved = normed_rows(x, norm, members[0].in_features, want_bf16=takes_bf16_rows(members))
        ys, h = finish_forward(members, x2, submit_forward(members, x2, x2b))
        ctx.save_for_backward(h, *saved)
        return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx: Any, *dys: Tensor) -> tuple[Tensor | None, ...]:
        members, norm = ctx.members, ctx.norm
        dys2 = [rows_fp32(dy, m.out_features) for m, dy in zip(members, dys, strict=True)]
        if ctx.one_call is not None:
            dx2, d_a_cat, d_b = lora_group_backward(
                dys2, ctx.saved_tensors, norm, ctx.one_call, lora_bs(members), scaling=members[0].scaling,
                need_x=ctx.needs_input_grad[2],
            )  # fmt: skip
            d_a = [d_a_cat[o : o + m.rank] for m, o in zip(members, _offsets(members), strict=True)]
            return None, None, None if dx2 is None else dx2.view(ctx.in_shape), *d_a, *d_b
        h, *saved = ctx.saved_tensors
        dx, g, d_b = backward_parts(members, h, dys2, need_x=ctx.needs_input_grad[2])
        d_a = rows_a_grads(members, norm, saved, g)
        dx_in = None if dx is None else norm_input_grad(norm, saved, dx, ctx.in_shape)
        return None, None, dx_in, *d_a, *d_b


def shared_input_lora(members: Sequence[LoRALinear], x: Tensor, norm: RMSNorm | None = None) -> tuple[Tensor, ...]:
    """``members[i](x)`` for every member, computed as one autograd node (``groupable(members)`` must hold); with
    ``norm``, ``members[i](rms_norm(x))``, the norm inside the node (it saves x, not the normed rows).

    Returns:
        One fp32 tensor per member, shaped ``[*x.shape[:-1], out_i]``.
    """
    ms = tuple(members)
    params = [m.lora_A for m in ms] + [m.lora_B for m in ms]
    out: tuple[Tensor, ...] = _SharedInputFn.apply(ms, norm, x, *params)  # type: ignore[no-untyped-call]  # torch's
    return out
