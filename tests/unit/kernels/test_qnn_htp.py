"""QNN HTP backend: regression tests for the EP's silent wrong-result cases, fallback, cache, memory forms."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from lorad.kernels import make_frozen_linear
from lorad.kernels._onnx import init, model_bytes, value
from lorad.kernels._qnn_graphs import audit_graph, fp16_dynamic_weight, fp16_static_weight, qdq_static
from lorad.kernels._quant import quantize_weight


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---- graph audit (no HTP needed) -------------------------------------------------------------------------------
def test_audit_flags_two_gemms_on_one_initializer() -> None:
    w = np.zeros((8, 8), np.float32)
    bad = model_bytes(
        [helper.make_node("Gemm", ["x", "W"], ["y"]), helper.make_node("Gemm", ["d", "W"], ["z"], transB=1)],
        [value("x", np.float32, [4, 8]), value("d", np.float32, [4, 8])],
        [value("y", np.float32, [4, 8]), value("z", np.float32, [4, 8])],
        [init("W", w)],
    )
    assert any("'W'" in p for p in audit_graph(bad))


def test_audit_flags_int4_dequantize_without_zero_point() -> None:
    q = helper.make_tensor("B", TensorProto.INT4, [8, 4], [1] * 32)
    bad = model_bytes(
        [
            helper.make_node("DequantizeLinear", ["B", "s"], ["Bd"], axis=1),
            helper.make_node("MatMul", ["x", "Bd"], ["y"]),
        ],
        [value("x", np.float32, [2, 8])],
        [value("y", np.float32, [2, 4])],
        [q, init("s", np.ones(4, np.float32))],
    )
    assert any("zero point" in p for p in audit_graph(bad))


def test_audit_flags_dynamic_dims() -> None:
    bad = model_bytes(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [value("x", np.float16, ["T", 8])],
        [value("y", np.float16, ["T", 4])],
        [init("W", np.zeros((8, 4), np.float16))],
    )
    assert any("dynamic" in p for p in audit_graph(bad))


@pytest.mark.parametrize(("out_f", "in_f"), [(16, 16), (24, 16), (16, 24)])
def test_every_graph_the_backend_builds_is_clean(out_f: int, in_f: int) -> None:
    w = torch.randn(out_f, in_f)
    bias = np.ones(out_f, np.float32)
    graphs = []
    for d in ("fwd", "bwd"):
        graphs.append(fp16_dynamic_weight(out_f, in_f, 32, True, d))
        graphs.append(fp16_static_weight(w.t().numpy(), 32, bias, d))
        for bits in (8, 4):
            q, s = quantize_weight(w, bits)
            graphs.append(qdq_static(q.t().numpy(), s.numpy(), 32, bits, 16, 1.0, "x"))
    for g in graphs:
        assert audit_graph(g) == []


# ---- on the HTP simulator --------------------------------------------------------------------------------------
@pytest.mark.htp
@pytest.mark.parametrize("form", ["dynamic", "static"])
def test_square_weight_both_directions_correct(htp_available: None, form: str) -> None:
    # Square W is where a shared-initializer Gemm pair returned x·Wᵀ for x·W silently (rel err 1.41).
    from lorad.kernels.qnn_htp import QnnFrozenLinear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g) * 0.05
    x, dy = torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)
    fl = QnnFrozenLinear(w, None, precision="fp16", precision_bwd="fp16", name="sq", cache_dir=None,
                         model_hash="", buckets=(64,), form=form)  # fmt: skip
    assert _rel(fl.forward(x), x @ w.t()) < 1e-3
    assert _rel(fl.input_grad(dy), dy @ w) < 1e-3


@pytest.mark.htp
def test_int4_per_channel_matches_cpu_emulation(htp_available: None) -> None:
    # Without an explicit INT4 zero point HTP gave rel err 3.65 where the CPU EP gave 0.14.
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 64, generator=g) * 0.05
    x = torch.randn(32, 64, generator=g)
    htp = make_frozen_linear(w, None, backend="qnn-htp", precision="w4a16", buckets=(32,))
    ref = make_frozen_linear(w, None, backend="torch", precision="w4a16")
    y = htp.forward(x)
    assert _rel(y, x @ w.t()) < 0.2
    assert _rel(y, ref.forward(x)) < 2e-2  # HTP error vs the same quantization emulated on the CPU


@pytest.mark.htp
def test_cpu_fallback_is_disabled(htp_available: None) -> None:
    # A symbolic dim cannot go to QNN; with fallback disabled session creation must fail rather than run on CPU.
    from lorad.kernels.qnn_htp import _session_options

    m = model_bytes(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [value("x", np.float16, ["T", 8])],
        [value("y", np.float16, ["T", 4])],
        [init("W", np.zeros((8, 4), np.float16))],
    )
    with pytest.raises(Exception, match=r"(?i)fallback|CPU"):
        ort.InferenceSession(m, sess_options=_session_options(None))


@pytest.mark.htp
def test_ep_context_cache_second_start_loads(htp_available: None, tmp_path: Path) -> None:
    from lorad.kernels.qnn_htp import QnnFrozenLinear, clear_session_pool

    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    x, dy = torch.randn(20, 64, generator=g), torch.randn(20, 96, generator=g)
    # fwd fp16 = weight-free dynamic graph (keyed by shape); bwd w8a16 = static graph (keyed by model hash + layer).
    kw = dict(precision="fp16", precision_bwd="w8a16", name="layers.0.q_proj", cache_dir=tmp_path,
              model_hash="abc123", buckets=(32,))  # fmt: skip
    clear_session_pool()
    t0 = time.perf_counter()
    first = QnnFrozenLinear(w, b, **kw)
    first.warmup()
    t_first = time.perf_counter() - t0
    assert set(first.sources.values()) == {"built"}
    assert len(list(tmp_path.glob("*_ctx.onnx"))) == 2
    clear_session_pool()  # a new process would start with an empty pool
    t0 = time.perf_counter()
    second = QnnFrozenLinear(w, b, **kw)
    second.warmup()
    t_second = time.perf_counter() - t0
    assert set(second.sources.values()) == {"cache"}
    torch.testing.assert_close(second.forward(x), first.forward(x), rtol=0, atol=0)
    torch.testing.assert_close(second.input_grad(dy), first.input_grad(dy), rtol=0, atol=0)
    print(f"first start {t_first * 1e3:.0f} ms, cached start {t_second * 1e3:.0f} ms")
    # Another base model: the weight-free forward graph is reused, the weight-bearing backward is rebuilt.
    clear_session_pool()
    other = QnnFrozenLinear(w * 2, b, **{**kw, "model_hash": "zzz"})
    other.warmup()
    assert other.sources == {("fwd", 32): "cache", ("bwd", 32): "built"}
    torch.testing.assert_close(other.forward(x) - b, 2 * (first.forward(x) - b), rtol=2e-3, atol=2e-3)


@pytest.mark.htp
def test_layers_of_one_shape_share_dynamic_sessions(htp_available: None) -> None:
    from lorad.kernels.qnn_htp import QnnFrozenLinear

    kw = dict(precision="fp16", precision_bwd="fp16", cache_dir=None, model_hash="", buckets=(16,))  # fmt: skip
    a = QnnFrozenLinear(torch.randn(40, 24), None, name="a", **kw)
    b = QnnFrozenLinear(torch.randn(40, 24), None, name="b", **kw)
    x = torch.randn(5, 24)
    ya, yb = a.forward(x), b.forward(x)
    assert a._sessions[("fwd", 16)] is b._sessions[("fwd", 16)]
    assert not torch.allclose(ya, yb)  # same session, each call fed its own weight


@pytest.mark.htp
def test_dynamic_form_holds_one_copy_static_one_per_graph(htp_available: None) -> None:
    from lorad.kernels.qnn_htp import QnnFrozenLinear

    w = torch.randn(64, 48) * 0.05
    common = dict(precision="fp16", precision_bwd="fp16", name="m", cache_dir=None, model_hash="",
                  buckets=(16, 32))  # fmt: skip
    dyn = QnnFrozenLinear(w, None, form="dynamic", **common)
    sta = QnnFrozenLinear(w, None, form="static", **common)
    fp16_bytes = 64 * 48 * 2
    assert dyn.nbytes == fp16_bytes
    assert sta.nbytes == 2 * 2 * fp16_bytes  # 2 directions × 2 buckets
    x = torch.randn(10, 48)
    torch.testing.assert_close(dyn.forward(x), sta.forward(x), rtol=1e-3, atol=1e-3)
