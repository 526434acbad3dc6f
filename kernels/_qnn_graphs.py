"""ONNX graphs for the QNN HTP backend (static token buckets) and an audit against the EP's silent-wrong cases."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from lorad.kernels._onnx import init, model_bytes, value

# Activation grids after per-call, per-row rescaling to [-1, 1] (docs/qnn_htp.md §2: static scales + per-call rescale).
ACT_GRID = {16: (np.uint16, 32768, 1.0 / 32767), 8: (np.uint8, 128, 1.0 / 127)}


def fp16_dynamic_weight(out_f: int, in_f: int, t: int, has_bias: bool, direction: str) -> bytes:
    """FP16 graph with the weight (and bias) as graph inputs, the weight in the tall layout (docs/qnn_htp.md §1: a wide
    dynamic-B MatMul prepares for ~15 s; ``[max(K,N), min(K,N)]`` prepares in ≤0.2 s).

    out >= in: ``W`` is nn.Linear [out, in]: fwd ``Gemm(x, W, transB=1)``, bwd ``MatMul(dy, W)``.
    out <  in: ``W`` is math [in, out]:      fwd ``MatMul(x, W)``,            bwd ``Gemm(dy, W, transB=1)``.
    The graph holds no weight data, so every layer of one shape can share one session per bucket.
    """
    linear_layout = out_f >= in_f
    w_shape = [out_f, in_f] if linear_layout else [in_f, out_f]
    a, k, n = ("x", in_f, out_f) if direction == "fwd" else ("dy", out_f, in_f)
    inputs = [value(a, np.float16, [t, k]), value("W", np.float16, w_shape)]
    nodes: list[onnx.NodeProto] = []
    gemm = (direction == "fwd") == linear_layout
    if gemm:
        nodes.append(helper.make_node("Gemm", [a, "W"], ["mm"], transB=1))
    else:
        nodes.append(helper.make_node("MatMul", [a, "W"], ["mm"]))
    if direction == "fwd" and has_bias:
        inputs.append(value("b", np.float16, [out_f]))
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    return model_bytes(nodes, inputs, [value("y", np.float16, [t, n])])


def fp16_static_weight(w_math: np.ndarray, t: int, bias: np.ndarray | None, direction: str) -> bytes:
    """FP16 graph with the weight as one initializer ``W`` [in, out] (math layout), one direction per graph.

    fwd ``MatMul(x, W)`` (+ bias) -> QNN FullyConnected; bwd ``Gemm(dy, W, transB=1)``. Separate graphs, so the
    Gemm transB=0/1 shared-initializer bug (docs/qnn_htp.md §1) cannot arise; QNN then holds one copy per graph.
    """
    in_f, out_f = w_math.shape
    if direction == "fwd":
        nodes = [helper.make_node("MatMul", ["x", "W"], ["mm" if bias is not None else "y"])]
        inits = [init("W", w_math.astype(np.float16))]
        if bias is not None:
            inits.append(init("b", bias.astype(np.float16)))
            nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
        return model_bytes(nodes, [value("x", np.float16, [t, in_f])], [value("y", np.float16, [t, out_f])], inits)
    nodes = [helper.make_node("Gemm", ["dy", "W"], ["y"], transB=1)]
    inits = [init("W", w_math.astype(np.float16))]
    return model_bytes(nodes, [value("dy", np.float16, [t, out_f])], [value("y", np.float16, [t, in_f])], inits)


def _int_weight(name: str, q: np.ndarray, bits: int) -> onnx.TensorProto:
    if bits == 8:
        return init(name, q.astype(np.int8))
    return helper.make_tensor(name, TensorProto.INT4, list(q.shape), q.astype(np.int8).flatten().tolist())


def _zero_point(name: str, n: int, bits: int) -> onnx.TensorProto:
    # Always explicit: INT4 per-channel DQ without a zero point is silently wrong on HTP (docs/qnn_htp.md §2).
    if bits == 8:
        return init(name, np.zeros(n, np.int8))
    return helper.make_tensor(name, TensorProto.INT4, [n], [0] * n)


def qdq_static(  # noqa: PLR0917 (all seven are needed; a config object would only move them)
    b_int: np.ndarray, b_scale: np.ndarray, t: int, w_bits: int, a_bits: int, out_bound: float, a_name: str
) -> bytes:
    """Full-QDQ graph ``DQ(Q(a)) · DQ(B)`` -> Q -> DQ with float32 I/O, static activation scales.

    Args:
        b_int: integer weight grid B [K, N] (values fit ``w_bits``), per-channel along N (axis=1, QNN's MatMul
            per-channel axis).
        b_scale: float32 [N] channel scales.
        t: token bucket (rows).
        w_bits, a_bits: weight and activation bits.
        out_bound: |output| bound for inputs in [-1, 1] (the caller rescales each row to that range).
        a_name: input name ("x" or "dy").
    """
    k, n = b_int.shape
    a_dtype, a_zp, a_scale = ACT_GRID[a_bits]
    qmax = 2 ** (a_bits - 1) - 1
    y_scale = max(out_bound, 1e-30) / qmax
    inits = [
        _int_weight("B", b_int, w_bits),
        init("B_s", b_scale.astype(np.float32)),
        _zero_point("B_z", n, w_bits),
        init("a_s", np.array(a_scale, np.float32)),
        init("a_z", np.array(a_zp, a_dtype)),
        init("y_s", np.array(y_scale, np.float32)),
        init("y_z", np.array(a_zp, a_dtype)),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", [a_name, "a_s", "a_z"], ["a_q"]),
        helper.make_node("DequantizeLinear", ["a_q", "a_s", "a_z"], ["a_dq"]),
        helper.make_node("DequantizeLinear", ["B", "B_s", "B_z"], ["B_dq"], axis=1),
        helper.make_node("MatMul", ["a_dq", "B_dq"], ["mm"]),
        helper.make_node("QuantizeLinear", ["mm", "y_s", "y_z"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_s", "y_z"], ["y"]),
    ]
    return model_bytes(nodes, [value(a_name, np.float32, [t, k])], [value("y", np.float32, [t, n])], inits)


def audit_graph(model: bytes | onnx.ModelProto) -> list[str]:
    """Problems that make QNN HTP silently wrong or slow (docs/qnn_htp.md §1–3); empty list = clean.

    Checks: (1) no initializer or input feeds two MatMul/Gemm nodes (the transB=0/1 shared-tensor bug),
    (2) every INT4 DequantizeLinear has an explicit zero point, (3) all graph inputs/outputs have static shapes.
    """
    m = onnx.load_from_string(model) if isinstance(model, bytes) else model
    g = m.graph
    problems: list[str] = []
    elem = {t.name: t.data_type for t in g.initializer}
    elem.update({v.name: v.type.tensor_type.elem_type for v in g.input})
    users: dict[str, list[str]] = {}
    for node in g.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            users.setdefault(node.input[1], []).append(f"{node.op_type}#{node.name or id(node)}")
        is_int4 = elem.get(node.input[0]) in (TensorProto.INT4, TensorProto.UINT4)
        if node.op_type == "DequantizeLinear" and is_int4 and (len(node.input) < 3 or not node.input[2]):
            problems.append(f"INT4 DequantizeLinear on {node.input[0]!r} has no zero point")
    for tensor, nodes in users.items():
        if len(nodes) > 1:
            problems.append(f"tensor {tensor!r} is the B operand of {len(nodes)} matmul nodes: {nodes}")
    for v in [*g.input, *g.output]:
        dims = v.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            problems.append(f"graph I/O {v.name!r} has a dynamic dimension")
    return problems
