"""ORT's ARM64 bf16 fast-math GEMM option against numpy fp32 (runs inside the arm64 root, independent of lorad)."""

from __future__ import annotations

import platform
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPTION = "mlas.enable_gemm_fastmath_arm64_bfloat16"
# bf16 keeps 8 significant bits: each rounded input is off by <= 2**-9 relative; with fp32 accumulation over K
# terms the normwise relative error of the product stays near 2**-8. 1e-2 leaves room; fp32 must be ~1e-6.
BF16_REL_TOL = 1e-2
FP32_REL_TOL = 1e-5
M, K, N = 64, 256, 128


def model(b: np.ndarray) -> bytes:
    """Y = A @ B with B a constant initializer (MLAS prepacks constant B, where the bf16 path applies)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["Y"])],
        "matmul",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
        [numpy_helper.from_array(b, "B")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m.SerializeToString()


def run(blob: bytes, a: np.ndarray, fastmath: bool) -> tuple[np.ndarray, float]:
    so = ort.SessionOptions()
    so.add_session_config_entry(OPTION, "1" if fastmath else "0")
    sess = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    (y,) = sess.run(None, {"A": a})
    return y, time.perf_counter() - t0


def main() -> int:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    # The reference must not come from the BLAS under test: einsum without optimize uses numpy's own loops. Under
    # qemu with SVE enabled, numpy's OpenBLAS fp64 GEMM was wrong (rel err ~1.2) while ORT was right.
    ref = np.einsum("ik,kj->ij", a.astype(np.float64), b.astype(np.float64), optimize=False)
    blob = model(b)
    print(f"machine {platform.machine()}, onnxruntime {ort.__version__}, MatMul {M}x{K} @ {K}x{N}")
    failed = 0
    with np.errstate(all="ignore"):
        blas = a.astype(np.float64) @ b.astype(np.float64)
    blas_rel = float(np.linalg.norm(blas - ref) / np.linalg.norm(ref))
    if blas_rel <= 1e-12:
        print(f"PASS numpy-blas-fp64 (rel err {blas_rel:.1e})")
    else:
        print(f"FAIL numpy-blas-fp64 (rel err {blas_rel:.1e}: the emulated CPU model breaks numpy's BLAS)")
        failed += 1
    errs = {}
    for fastmath, tol in ((False, FP32_REL_TOL), (True, BF16_REL_TOL)):
        y, secs = run(blob, a, fastmath)
        rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        worst = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
        errs[fastmath] = rel
        name = f"ort-matmul-{'bf16-fastmath' if fastmath else 'fp32'}"
        line = f"{name} (rel err {rel:.2e}, max err/max|ref| {worst:.2e}, tol {tol:.0e}, {secs * 1e3:.0f} ms)"
        if rel <= tol:
            print(f"PASS {line}")
        else:
            print(f"FAIL {line}")
            failed += 1
    # Identical errors mean the option changed nothing here (no BF16 in the CPU's hwcaps, or MLAS took another path).
    effect = "bf16 path taken" if errs[True] > 10 * errs[False] else "no measurable effect (fp32 path kept)"
    print(f"[bf16] fast-math option: {effect}; reference: numpy einsum in fp64")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
