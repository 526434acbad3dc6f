"""ONNX Runtime CPU-EP backend: fp32 and per-channel int8 (w8a8), one weight copy serving both directions.

The weight is a graph *input* (not an initializer) of two small sessions, forward and input-gradient, so the
single numpy buffer held here is the only copy (ORT would otherwise keep a prepacked copy per session).
- fp32: forward ``Gemm(x, W, b, transB=1)``, backward ``MatMul(dy, W)``; W is [out, in] (nn.Linear layout).
- w8a8: W stored once as int8 [out, in] with per-output-channel scales s. Forward ``x·(Wq·diag(s))ᵀ``:
  ``DynamicQuantizeMatMul(x/r, Transpose(Wq), s, 0)·r (+b)`` with r the per-row (per-token) absmax of x, so each
  token gets its own uint8 activation scale (``act_quant="row"``, default) instead of one per call (``"tensor"``).
  Backward ``dy·diag(s)·Wq``: fold s into dy, then the same per-row form against the same int8 tensor, which is
  already the [K=out, N=in] layout the backward product needs.
  Measured (bench/kernels.py, T=256, 2 cores, SmolLM2 shapes): rows scaled by exp(N(0, 1.5²)) give rel error
  ~1.1e-2 per row vs 4.5e-2..1.0e-1 per tensor (equal rows: 1.1e-2 vs 1.3e-2); cost +16-30% on block linears
  (576x576: 0.36 vs 0.31 ms fwd) and none on the 49152x576 lm_head (34.5 vs 35.0 ms); an explicit
  Round/Cast/MatMulInteger graph was slower (0.79 vs 0.61 ms at 1536x576, 43 vs 35 ms on the lm_head).
- On x86 CPUs without int8 dot-product instructions (no VNNI: AVX2 and plain AVX-512 parts, such as an AVX2-only EPYC),
  ONNX Runtime's uint8 x int8 kernel multiplies with VPMADDUBSW, which adds each pair of u8·s8 products into a
  saturating int16: sums past 32767 are clipped, silently. Measured on such a host (T=256, SmolLM2 shapes): 1.6-2.2e-2
  relative error at 576x576..1536x576 and 5.6e-2 on a 48x80 layer, against 1.1e-2 from 8-bit rounding alone. There the
  one weight copy is stored as uint8 with zero point 128 (``int8_weight_format``), which runs ORT's uint8 x uint8
  kernel (16-bit products widened before they are added: no saturation), same bytes; in a quiet microbenchmark it
  took the same time as the saturating kernel at 576x576 and 576x1536 (within 5 %) and up to 1.45x at 1536x576
  (input gradient 14.8 vs 10.2 ms), the price of right results; the planner times what runs.
Shapes are dynamic (symbolic T), so no padding is needed on the CPU.
Measured (2-core EPYC, T=256): a prepacked int8 initializer is ~2x faster than a graph input only for the 28 MB
lm_head (25 vs 52 ms fwd) and 10-20% for block linears, at the cost of a second packed copy per direction, so one
copy wins. IOBinding with ORT-allocated outputs aliases the output buffer across runs, and binding a fresh torch
output was no faster than ``run()`` (367 vs 373 us at 576x576), so plain ``run()`` is used.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from onnx import helper
from torch import Tensor

from lorad.kernels._onnx import MS_DOMAIN, init, model_bytes, value
from lorad.kernels._quant import check_precision, quantize_weight
from lorad.kernels.capabilities import CAPABILITIES, cpu_int8, is_x86

SUPPORTED = CAPABILITIES["ort-cpu"].precisions


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """CPU-EP options: intra-op threads = cores, sequential execution, no spinning (the caller thread computes the
    LoRA terms concurrently and must not compete with idle-spinning ORT workers)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or os.cpu_count() or 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # No per-session memory arena: with one session per frozen linear the arenas kept ~1.5-2 MB each alive
    # between calls (SmolLM2 training peak 1811 -> 1522 MB without them, no measurable slowdown).
    so.enable_cpu_mem_arena = False
    so.log_severity_level = 3
    return so


# Weight-free graphs (the weight is a graph input) are identical for every linear of one shape, so one session
# serves them all: SmolLM2 fp32 needs ~14 sessions instead of 422. Weak values: a session lives while a linear
# uses it. InferenceSession.run is thread-safe.
_POOL: weakref.WeakValueDictionary[str, ort.InferenceSession] = weakref.WeakValueDictionary()
_POOL_LOCK = threading.Lock()


def _session(model: bytes) -> ort.InferenceSession:
    key = hashlib.sha256(model).hexdigest()
    with _POOL_LOCK:
        sess = _POOL.get(key)
        if sess is None:
            sess = ort.InferenceSession(model, sess_options=session_options(), providers=["CPUExecutionProvider"])
            _POOL[key] = sess
        return sess


def pooled_sessions() -> int:
    """Number of distinct ORT CPU sessions alive (shared by every frozen linear with the same graph)."""
    return len(_POOL)


def fp32_graphs(out_f: int, in_f: int, bias: np.ndarray | None) -> tuple[bytes, bytes]:
    """(forward, input-grad) models with the fp32 weight W [out, in] as graph input ``W``."""
    b_in = ["b"] if bias is not None else []
    b_init = [init("b", bias)] if bias is not None else []
    fwd = model_bytes(
        [helper.make_node("Gemm", ["x", "W", *b_in], ["y"], transB=1)],
        [value("x", np.float32, ["T", in_f]), value("W", np.float32, [out_f, in_f])],
        [value("y", np.float32, ["T", out_f])],
        b_init,
    )
    bwd = model_bytes(
        [helper.make_node("MatMul", ["dy", "W"], ["dx"])],
        [value("dy", np.float32, ["T", out_f]), value("W", np.float32, [out_f, in_f])],
        [value("dx", np.float32, ["T", in_f])],
    )
    return fwd, bwd


ACT_QUANT = ("row", "tensor")
WEIGHT_FORMATS: dict[str, tuple[type, int]] = {"s8": (np.int8, 0), "u8": (np.uint8, 128)}
"""Stored forms of the w8a8 weight grid (values in [-127, 127]): numpy dtype and zero point."""


def int8_weight_format() -> str:
    """How this machine stores the w8a8 weight for ONNX Runtime: ``"s8"`` (int8, zero point 0) where its u8·s8 kernel
    is exact (int8 dot products on x86, any ARM core), ``"u8"`` (uint8, zero point 128: the same grid shifted) on x86
    without them, where that kernel saturates int16 pair sums (module docstring)."""
    return "u8" if is_x86() and not cpu_int8().native else "s8"


def _stored_weight(q: np.ndarray, fmt: str) -> np.ndarray:
    """Weight grid ``q`` (int8) in the stored form ``fmt`` (``WEIGHT_FORMATS``)."""
    dtype, zp = WEIGHT_FORMATS[fmt]
    return q if zp == 0 else (q.astype(np.int16) + zp).astype(dtype)


def _row_quant_matmul(a: str, w: str, w_scale: str, w_zp: str, out: str) -> list[Any]:
    """Nodes for ``out = a · dequant(w)`` with one activation scale per row of ``a``.

    Each row is divided by its own absmax, so every row spans [-1, 1] and the per-call uint8 scale that
    DynamicQuantizeMatMul derives from the whole tensor is, in effect, per row (step 2/255 of each row's absmax);
    the row's absmax is multiplied back into the output, exact because the product is linear in each row.
    Measured at SmolLM2 shapes this keeps the fused int8 kernel and beats an explicit Round/Cast/MatMulInteger
    graph (bench/kernels.py).
    """
    n = f"{a}_"
    return [
        helper.make_node("Abs", [a], [n + "abs"]),
        helper.make_node("ReduceMax", [n + "abs", "axis1"], [n + "amax"], keepdims=1),
        helper.make_node("Max", [n + "amax", "tiny"], [n + "s"]),  # [T, 1]; all-zero rows stay zero
        helper.make_node("Div", [a, n + "s"], [n + "unit"]),
        helper.make_node("DynamicQuantizeMatMul", [n + "unit", w, w_scale, w_zp], [n + "acc"], domain=MS_DOMAIN),
        helper.make_node("Mul", [n + "acc", n + "s"], [out]),
    ]


def _row_consts() -> list[Any]:
    return [init("axis1", np.array([1], np.int64)), init("tiny", np.array(1e-30, np.float32))]


def int8_graphs(
    out_f: int,
    in_f: int,
    scale: np.ndarray,
    bias: np.ndarray | None,
    *,
    act_quant: str = "row",
    weight_format: str = "s8",
) -> tuple[bytes, bytes]:
    """(forward, input-grad) models with the quantized weight Wq [out, in] as graph input ``W`` (same for both).

    ``act_quant="row"``: one activation scale per row (token), see ``_row_quant_matmul``; ``"tensor"``: one scale
    per call (DynamicQuantizeLinear inside DynamicQuantizeMatMul), where one outlier token coarsens every row.
    ``weight_format``: ``"s8"`` (int8, zero point 0) or ``"u8"`` (uint8, zero point 128), see ``int8_weight_format``.
    """
    if act_quant not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}, got {act_quant!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {tuple(WEIGHT_FORMATS)}, got {weight_format!r}")
    wdt, zp = WEIGHT_FORMATS[weight_format]
    w_in = value("W", wdt, [out_f, in_f])
    b_init = [init("b", bias)] if bias is not None else []
    if act_quant == "tensor":
        fwd_inputs = ["x", "Wt", "s", "zo", *(["b"] if bias is not None else [])]
        fwd_nodes = [
            helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
            helper.make_node("DynamicQuantizeMatMul", fwd_inputs, ["y"], domain=MS_DOMAIN),
        ]
        fwd_inits = [init("s", scale), init("zo", np.full(out_f, zp, wdt)), *b_init]
        bwd_nodes = [
            # dy·diag(s)·Wq: the per-output-channel scale is folded into dy so Wq serves as B unchanged.
            helper.make_node("Mul", ["dy", "s"], ["dys"]),
            helper.make_node("DynamicQuantizeMatMul", ["dys", "W", "one", "z0"], ["dx"], domain=MS_DOMAIN),
        ]
        bwd_inits = [init("s", scale), init("one", np.array(1.0, np.float32)), init("z0", np.array(zp, wdt))]
    else:
        y_out = "yb" if bias is not None else "y"
        fwd_nodes = [
            helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
            *_row_quant_matmul("x", "Wt", "s", "zo", y_out),
            *([helper.make_node("Add", ["yb", "b"], ["y"])] if bias is not None else []),
        ]
        fwd_inits = [init("s", scale), init("zo", np.full(out_f, zp, wdt)), *_row_consts(), *b_init]
        # Fold the per-channel weight scale into dy first, so each row's scale covers what multiplies Wq.
        bwd_nodes = [helper.make_node("Mul", ["dy", "s"], ["dys"]), *_row_quant_matmul("dys", "W", "one", "z0", "dx")]
        bwd_inits = [
            init("s", scale),
            init("one", np.array(1.0, np.float32)),
            init("z0", np.array(zp, wdt)),
            *_row_consts(),
        ]
    fwd = model_bytes(
        fwd_nodes, [value("x", np.float32, ["T", in_f]), w_in], [value("y", np.float32, ["T", out_f])], fwd_inits
    )
    bwd = model_bytes(
        bwd_nodes, [value("dy", np.float32, ["T", out_f]), w_in], [value("dx", np.float32, ["T", in_f])], bwd_inits
    )
    return fwd, bwd


class _Direction:
    """One session plus the weight OrtValue it reads (zero-copy view of the stored numpy buffer)."""

    def __init__(self, model: bytes, in_name: str, weight: np.ndarray) -> None:
        self.sess = _session(model)
        self.in_name = in_name
        self.weight = ort.OrtValue.ortvalue_from_numpy(weight)
        self.out_name = self.sess.get_outputs()[0].name

    def __call__(self, a: Tensor) -> Tensor:
        a_np = a.detach().float().contiguous().numpy()
        feeds: dict[str, Any] = {self.in_name: a_np, "W": self.weight}
        out = self.sess.run([self.out_name], feeds)[0]
        return torch.from_numpy(out)


class OrtCpuFrozenLinear:
    """Frozen linear on the ONNX Runtime CPU EP (see module docstring for the graphs)."""

    runs_on_cpu = True  # calls run inline on the caller's thread (see queue.queue_for)

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        precision: str,
        precision_bwd: str,
        name: str,
        act_quant: str = "row",
        weight_format: str | None = None,
    ) -> None:
        check_precision("ort-cpu", precision)
        check_precision("ort-cpu", precision_bwd)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.name = name
        self.precision_fwd, self.precision_bwd = precision, precision_bwd
        self.act_quant = act_quant
        self.weight_format = weight_format or int8_weight_format()
        b = None if bias is None else bias.detach().float().contiguous().numpy().copy()
        self._arrays: dict[str, np.ndarray] = {}
        graphs: dict[str, tuple[bytes, bytes]] = {}
        o, i = self.out_features, self.in_features
        for p in {precision, precision_bwd}:
            if p == "fp32":
                self._arrays["fp32"] = weight.detach().float().contiguous().numpy().copy()
                graphs[p] = fp32_graphs(o, i, b)
            else:
                q, s = quantize_weight(weight, 8)
                self._arrays["w8"] = _stored_weight(q.numpy(), self.weight_format)
                self._arrays["w8_scale"] = s.numpy()
                graphs[p] = int8_graphs(o, i, s.numpy(), b, act_quant=act_quant, weight_format=self.weight_format)
        key = {"fp32": "fp32", "w8a8": "w8"}
        self._fwd = _Direction(graphs[precision][0], "x", self._arrays[key[precision]])
        self._bwd = _Direction(graphs[precision_bwd][1], "dy", self._arrays[key[precision_bwd]])
        self._bias_bytes = 0 if b is None else b.nbytes

    @property
    def nbytes(self) -> int:
        # Weight buffers (+ per-channel scales) held here; the sessions reference them, they keep no copy.
        # Bias and scale constants are also embedded in the graphs (tiny: out_features floats each).
        return sum(a.nbytes for a in self._arrays.values()) + self._bias_bytes

    def forward(self, x: Tensor) -> Tensor:
        return self._fwd(x)

    def input_grad(self, dy: Tensor) -> Tensor:
        return self._bwd(dy)
