"""Torch backend: exact fp32 reference; native bf16 (oneDNN) and w8a8 (int8 GEMM) on CPUs with the instructions.

Other precisions, and bf16/w8a8 on CPUs without bf16/int8 dot products, are emulated (same numbers, no gain).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from lorad.kernels._quant import ACT_BITS, WEIGHT_BITS, check_precision, fake_quant_act, quantize_rows, quantize_weight
from lorad.kernels.capabilities import CAPABILITIES, cpu_int8
from lorad.kernels.fused import int8_rescale, quantize_rows_i8, small_rows_bf16

SUPPORTED = CAPABILITIES["torch"].precisions


class TorchFrozenLinear:
    """Frozen linear in torch. Holds one weight copy per distinct precision (one when fwd == bwd precision).

    Quantized precisions store an int8 grid (int4 values in int8 cells, so 1 byte/weight here) plus per-channel
    scales and dequantize per call; activations get a per-row (per-token) per-call scale, which is what the ort-cpu
    w8a8 graphs and the NPU backends' per-call rescaling compute.

    w8a8 on a CPU with int8 dot products runs as a real int8 GEMM (``torch._int_mm``, exact int32 accumulation) from
    the one int8 copy: forward ``(xq·Wqᵀ)·sx·sw``; input gradient ``(q(dy·sw)·Wq)·s`` with the per-output-channel
    weight scale folded into dy before its per-row quantization (the reduction runs over output channels, so the
    scale cannot be applied after it), as the ort-cpu w8a8 graphs do. The emulated path computes the same numbers.
    """

    runs_on_cpu = True  # calls run inline on the caller's thread (see queue.queue_for)

    def __init__(self, weight: Tensor, bias: Tensor | None, *, precision: str, precision_bwd: str, name: str) -> None:
        check_precision("torch", precision)
        check_precision("torch", precision_bwd)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.name = name
        self.precision_fwd = precision
        self.precision_bwd = precision_bwd
        self._store: dict[str, tuple[Tensor, Tensor | None]] = {}
        for p in {precision, precision_bwd}:
            self._store[p] = _encode(weight, p)
        self.bias = None if bias is None else bias.detach().float().clone()
        # Set by stack_bf16: the [Σout, in] tensor this layer's bf16 weight is a row block of, and its group in order
        # (weak references: no cycle keeps a dropped model's weights alive).
        self._joint: tuple[Tensor, tuple[weakref.ref[TorchFrozenLinear], ...]] | None = None

    @property
    def nbytes(self) -> int:
        n = sum(w.numel() * w.element_size() + (0 if s is None else s.numel() * 4) for w, s in self._store.values())
        return n + (0 if self.bias is None else self.bias.numel() * 4)

    def _dense(self, precision: str) -> Tensor:
        w, s = self._store[precision]
        if s is None:
            return w.float() if w.dtype != torch.float32 else w
        return w.float() * s[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if self.precision_fwd == "bf16":
            return self.widen(self.bf16_product(x))
        if self.precision_fwd == "w8a8":
            wq, sw = self._store["w8a8"]
            assert sw is not None
            return _int8_mm(x, wq.t(), col_scale=sw, bias=self.bias)
        x = _act(x.float(), self.precision_fwd)
        w = self._dense(self.precision_fwd)
        y = x @ w.t() if self.bias is None else torch.addmm(self.bias, x, w.t())
        return y

    def bf16_product(self, x: Tensor, *, out: Tensor | None = None) -> Tensor:
        """``x·Wᵀ`` as the bf16 GEMM returns it (bf16 operands, fp32 accumulation inside oneDNN, a bf16 result);
        only at forward precision bf16. ``forward(x)`` is ``widen`` of it, so a caller may keep this half-size tensor
        and rebuild the output bit for bit later. A row or two (generation's tokens) run ``small_rows_bf16``. With
        ``out`` (a contiguous bf16 [rows, out_features]), the GEMM writes there, the same bits."""
        w = self._store["bf16"][0]
        if out is not None:
            return torch.mm(x.to(torch.bfloat16), w.t(), out=out)
        small = small_rows_bf16(x, w)
        return small if small is not None else torch.mm(x.to(torch.bfloat16), w.t())

    def input_grad_product(self, dy: Tensor) -> Tensor:
        """``dy·W`` [T, in] as the bf16 GEMM returns it (``dy`` rounded to bf16 unless it is bf16, fp32 accumulation
        inside oneDNN, a bf16 result); only at backward precision bf16. ``input_grad(dy)`` is it widened."""
        return torch.mm(dy.to(torch.bfloat16), self._store["bf16"][0])

    def input_grad_bf16(self, dy: Tensor) -> Tensor:
        """``input_grad`` of an output gradient already in bf16 (only at backward precision bf16): float32 [T, in]."""
        return self.input_grad_product(dy).float()

    def widen(self, product: Tensor) -> Tensor:
        """The float32 output from ``bf16_product``'s result: widened once, the bias added in fp32."""
        y = product.float()
        return y if self.bias is None else y.add_(self.bias)

    def input_grad(self, dy: Tensor) -> Tensor:
        if self.precision_bwd == "bf16":
            return self.input_grad_bf16(dy)
        if self.precision_bwd == "w8a8":
            wq, sw = self._store["w8a8"]
            assert sw is not None
            return _int8_mm(dy, wq, row_fold=sw)
        dy = _act(dy.float(), self.precision_bwd)
        return dy @ self._dense(self.precision_bwd)


def stack_bf16(layers: Sequence[object]) -> bool:
    """Moves the bf16 weights of layers that read one input (q/k/v; gate/up) into one [Σout, in] tensor, each
    layer's weight a row block of it (a contiguous view, so its own calls are unchanged): ``joint_bf16`` then finds
    them and one GEMM serves the group in each direction. The same bytes; True when the layers were stacked.

    Only torch layers at bf16 in both directions with one ``in_features``; others are left alone, and layers already
    stacked stay as they are (True).
    """
    if len(layers) < 2 or not all(_bf16_both_ways(f) for f in layers):
        return False
    if joint_bf16(layers) is not None:
        return True
    fs = [f for f in layers if isinstance(f, TorchFrozenLinear)]
    if len({f.in_features for f in fs}) != 1:
        return False
    joint = torch.cat([f._store["bf16"][0] for f in fs])
    group = tuple(weakref.ref(f) for f in fs)
    start = 0
    for f in fs:
        f._store["bf16"] = (joint[start : start + f.out_features], None)
        f._joint = (joint, group)
        start += f.out_features
    return True


def joint_bf16(layers: Sequence[object]) -> Tensor | None:
    """The [Σout, in] bf16 weight whose consecutive row blocks are these layers' weights (``stack_bf16`` made it;
    for a single torch layer at bf16 both ways, its own weight: a group of one), or None when they are not stacked
    (another backend or precision, a layer the planner rebuilt, another order).

    ``x·Jᵀ`` is then every layer's bf16 product side by side, and ``[dy_1 … dy_n]·J`` the sum of their input
    gradients: one GEMM a direction instead of one per layer, a single bf16 rounding of the summed dX instead of one
    per layer, and the input converted to bf16 once. Per SmolLM2 layer (T = 256, 2 threads, AMX host, bf16 products
    with conversions): q/k/v 0.40 -> 0.26 ms forward, 0.39 -> 0.29 ms input gradient; gate/up 0.79 -> 0.66 and
    0.93 -> 0.77 ms.
    """
    first = layers[0] if layers else None
    if len(layers) == 1 and isinstance(first, TorchFrozenLinear) and _bf16_both_ways(first):
        return first._store["bf16"][0]
    if len(layers) < 2 or not isinstance(first, TorchFrozenLinear) or first._joint is None:
        return None
    joint, group = first._joint
    if len(group) != len(layers) or any(ref() is not f for ref, f in zip(group, layers, strict=True)):
        return None
    return joint


def bf16_gemm(frozen: object, *, backward: bool = False) -> TorchFrozenLinear | None:
    """``frozen`` when its forward (``backward``: its input gradient) is a torch bf16 GEMM, whose bf16 product a
    caller may take and finish itself (``fused.widen_lowrank``), else None."""
    if not isinstance(frozen, TorchFrozenLinear):
        return None
    return frozen if (frozen.precision_bwd if backward else frozen.precision_fwd) == "bf16" else None


def joint_input_grad_product(joint: Tensor, dys: Sequence[Tensor], *, packed: Tensor | None = None) -> Tensor:
    """``Σ dy_i·W_i`` [T, in] as one bf16 GEMM returns it (bf16): the output gradients side by side in bf16 (each
    converted straight into its columns, or ``packed``: that [T, Σout] bf16 matrix already made) times the stacked
    weight, fp32 accumulation, one bf16 rounding of the sum."""
    d = packed
    if d is None:
        d = torch.empty(dys[0].shape[0], joint.shape[0], dtype=torch.bfloat16)
        start = 0
        for dy in dys:
            d[:, start : start + dy.shape[1]].copy_(dy)
            start += dy.shape[1]
    return torch.mm(d, joint)


def _bf16_both_ways(f: object) -> bool:
    return isinstance(f, TorchFrozenLinear) and f.precision_fwd == f.precision_bwd == "bf16"


def _int8_mm(
    a: Tensor, b: Tensor, *, row_fold: Tensor | None = None, col_scale: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """``q(a·diag(row_fold))·b`` rescaled by the quantized rows' scales, then by ``col_scale`` per output column, plus
    ``bias``: float32 [T, N]; ``b`` [K, N] int8 (a transposed view is fine). The forward passes the weight's output
    channel scales as ``col_scale``; the input gradient folds them into dy (``row_fold``) before quantizing.

    Natively an int8 GEMM with exact int32 accumulation, quantization and rescaling one fused pass each where the
    kernels run (the same bits as the torch ops); without int8 dot products the same grid multiplied in float32 (the
    emulation: same numbers up to fp32 rounding of the sums, no speed gain).
    """
    a = a.float()
    got = quantize_rows_i8(a, row_fold)
    q, s = got if got is not None else quantize_rows(a if row_fold is None else a * row_fold, 8)
    if cpu_int8().native:
        acc = torch._int_mm(q, b)
        y = int8_rescale(acc, s, col_scale, bias)
        if y is not None:
            return y
        y = acc.float().mul_(s)
    else:
        y = (q.float() @ b.float()).mul_(s)
    if col_scale is not None:
        y.mul_(col_scale)
    return y if bias is None else y.add_(bias)


def _encode(weight: Tensor, precision: str) -> tuple[Tensor, Tensor | None]:
    w = weight.detach()
    if precision == "fp32":
        return w.float().contiguous().clone(), None
    if precision in ("fp16", "bf16"):
        return w.to(torch.float16 if precision == "fp16" else torch.bfloat16).contiguous(), None
    q, s = quantize_weight(w, WEIGHT_BITS[precision])
    return q, s


def _act(a: Tensor, precision: str) -> Tensor:
    if precision == "fp32":
        return a
    if precision == "fp16":
        return a.to(torch.float16).float()
    return fake_quant_act(a, ACT_BITS[precision])
