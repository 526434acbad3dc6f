"""Small ONNX graph-building helpers shared by the ONNX Runtime backends."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"

_NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.int32): TensorProto.INT32,
}


def onnx_type(dtype: np.dtype | type) -> int:
    """ONNX TensorProto element type of a numpy dtype."""
    return _NP_TO_ONNX[np.dtype(dtype)]


def value(name: str, dtype: np.dtype | type, shape: Sequence[int | str]) -> onnx.ValueInfoProto:
    """A graph input/output description."""
    return helper.make_tensor_value_info(name, onnx_type(dtype), list(shape))


def init(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer from a numpy array."""
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def model_bytes(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    *,
    opset: int = 21,
    name: str = "frozen_linear",
) -> bytes:
    """Serialize a single-graph model (ONNX opset ``opset`` plus com.microsoft v1), checked by onnx.checker."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)], producer_name="lorad"
    )
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()
