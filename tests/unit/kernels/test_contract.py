"""Contract suite every backend passes: forward and input gradient vs torch fp32, per precision, with tolerances."""

from __future__ import annotations

import pytest
import torch

from lorad.kernels import BACKENDS, PRECISIONS, make_frozen_linear, memory_report
from lorad.kernels.capabilities import CAPABILITIES

# Relative-norm tolerance vs exact fp32 per precision (docs/qnn_htp.md §2 measured 3.6e-4 fp16, 7.8e-3 w8a16,
# 1.8e-2 w8a8, 0.13 w4a16 at 896²; small layers are noisier, hence the margins). bf16: operands and result rounded
# to 8 significant bits (unit roundoff 2^-9 ≈ 2e-3 each), fp32 accumulation: ~3e-3 measured, 8e-3 allowed.
REL_TOL = {"fp32": 1e-5, "bf16": 8e-3, "fp16": 2e-3, "w8a16": 2.5e-2, "w8a8": 5e-2, "w4a16": 0.25}
# What the contract suite runs: every precision of the capability table (w4a16 on HTP is left to the planner tests).
SUPPORTED = {b: tuple(p for p in CAPABILITIES[b].precisions if (b, p) != ("qnn-htp", "w4a16")) for b in BACKENDS}
CASES = [(b, p) for b in BACKENDS for p in PRECISIONS if p in SUPPORTED[b]]
MARKS = {"qnn-htp": [pytest.mark.htp]}


def _params() -> list[object]:
    return [pytest.param(b, p, id=f"{b}-{p}", marks=MARKS.get(b, [])) for b, p in CASES]


def _data(out_f: int = 48, in_f: int = 80, t: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    b = torch.randn(out_f, generator=g) * 0.1
    x = torch.randn(t, in_f, generator=g)
    dy = torch.randn(t, out_f, generator=g) * 1e-3  # gradient-sized: exercises per-call rescaling
    return w, b, x, dy


def _err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return (got - ref).abs().max().item(), ((got - ref).norm() / ref.norm()).item()


@pytest.fixture
def maybe_htp(request: pytest.FixtureRequest) -> None:
    if request.node.callspec.params["backend"] == "qnn-htp":
        request.getfixturevalue("htp_available")


@pytest.mark.parametrize(("backend", "precision"), _params())
def test_forward_and_input_grad_match_fp32(maybe_htp: None, backend: str, precision: str) -> None:
    w, b, x, dy = _data()
    fl = make_frozen_linear(w, b, backend=backend, precision=precision, name="probe", buckets=(16, 32))
    y, dx = fl.forward(x), fl.input_grad(dy)
    assert y.shape == (37, 48) and dx.shape == (37, 80)
    assert y.dtype == torch.float32 and dx.dtype == torch.float32
    # Bias is large relative to x·Wᵀ only in scale; compare the product part separately so bias can't hide errors.
    y_abs, y_rel = _err(y - b, x @ w.t())
    dx_abs, dx_rel = _err(dx, dy @ w)
    print(f"{backend}/{precision}: fwd max|d|={y_abs:.2e} rel={y_rel:.2e}; bwd max|d|={dx_abs:.2e} rel={dx_rel:.2e}")
    assert y_rel <= REL_TOL[precision], (y_abs, y_rel)
    assert dx_rel <= REL_TOL[precision], (dx_abs, dx_rel)
    # A different T (other bucket / padding; per-tensor activation scale may change) agrees within tolerance.
    assert _err(fl.forward(x[:5]), y[:5])[1] <= 2 * REL_TOL[precision]
    assert fl.nbytes > 0


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "fp32"])
def test_torch_emulation_actually_lowers_precision(precision: str) -> None:
    w, b, x, dy = _data()
    fl = make_frozen_linear(w, b, backend="torch", precision=precision)
    assert _err(fl.forward(x), x @ w.t() + b)[1] > 1e-6
    assert _err(fl.input_grad(dy), dy @ w)[1] > 1e-6


@pytest.mark.parametrize(("backend", "precision"), [("ort-cpu", "fp16"), ("ort-cpu", "w4a16"), ("torch", "int3")])
def test_unsupported_precision_names_backend_and_precision(backend: str, precision: str) -> None:
    w, b, _, _ = _data()
    with pytest.raises(ValueError, match=rf"{backend}.*{precision}|{precision}.*{backend}"):
        make_frozen_linear(w, b, backend=backend, precision=precision)


def test_unknown_backend_rejected() -> None:
    with pytest.raises(ValueError, match="tpu"):
        make_frozen_linear(torch.zeros(2, 2), None, backend="tpu")


def test_mixed_precision_directions_and_memory_report() -> None:
    w, b, x, dy = _data()
    fp = make_frozen_linear(w, b, backend="ort-cpu", precision="fp32", name="a")
    q = make_frozen_linear(w, b, backend="ort-cpu", precision="w8a8", name="b")
    mixed = make_frozen_linear(w, b, backend="ort-cpu", precision="fp32", precision_bwd="w8a8", name="c")
    assert (mixed.precision_fwd, mixed.precision_bwd) == ("fp32", "w8a8")
    torch.testing.assert_close(mixed.forward(x), fp.forward(x))
    torch.testing.assert_close(mixed.input_grad(dy), q.input_grad(dy))
    # One copy per stored format: fp32 4 B/weight, int8 1 B/weight + 4 B/channel scale, + fp32 bias.
    n = 48 * 80
    assert fp.nbytes == 4 * n + 4 * 48
    assert q.nbytes == n + 4 * 48 + 4 * 48
    assert mixed.nbytes == 4 * n + n + 4 * 48 + 4 * 48
    rep = memory_report([fp, q, mixed])
    assert rep["total_bytes"] == fp.nbytes + q.nbytes + mixed.nbytes
    assert rep["per_weight"]["b"]["precision_fwd"] == "w8a8"


def test_ort_cpu_w8a8_scales_activations_per_row() -> None:
    """One loud token must not coarsen the others: per-row error stays flat where per-tensor blows up."""
    from lorad.kernels.ort_cpu import OrtCpuFrozenLinear

    w, b, x, dy = _data()
    skew = torch.ones(x.shape[0], 1)
    skew[0] = 1e3  # an attention-sink-like row, 1000x the others
    xs, dys = x * skew, dy * skew
    errs = {}
    for mode in ("row", "tensor"):
        fl = OrtCpuFrozenLinear(w, b, precision="w8a8", precision_bwd="w8a8", name="p", act_quant=mode)
        # Error on the quiet rows only (the loud row is fine either way).
        y_rel = _err((fl.forward(xs) - b)[1:], (xs @ w.t())[1:])[1]
        dx_rel = _err(fl.input_grad(dys)[1:], (dys @ w)[1:])[1]
        errs[mode] = (y_rel, dx_rel)
    print(errs)
    assert max(errs["row"]) <= REL_TOL["w8a8"]
    assert min(errs["tensor"]) > 10 * max(errs["row"])


def test_ort_cpu_w8a8_stays_at_8_bit_rounding_error_on_this_cpu() -> None:
    """Without VNNI, ORT's u8·s8 kernel adds product pairs into a saturating int16 (2.1e-2 here instead of 1.1e-2 at
    576x576 on an AVX2-only EPYC): the weight format this machine gets, and uint8 on any machine, must not saturate."""
    from lorad.kernels.ort_cpu import OrtCpuFrozenLinear, int8_weight_format

    w, b, x, dy = _data(out_f=576, in_f=576, t=256, seed=3)
    x = x * 4.0  # activations that fill the uint8 grid's rows as real ones do
    got = {}
    for fmt in sorted({int8_weight_format(), "u8"}):
        fl = OrtCpuFrozenLinear(w, b, precision="w8a8", precision_bwd="w8a8", name="p", weight_format=fmt)
        assert fl.nbytes == w.numel() + 576 * 4 + b.numel() * 4  # one byte a weight either way
        got[fmt] = (fl.forward(x) - b, fl.input_grad(dy))
        errs = (_err(got[fmt][0], x @ w.t())[1], _err(got[fmt][1], dy @ w)[1])
        print(fmt, errs)
        assert max(errs) <= 1.5e-2, (fmt, errs)
    if len(got) == 2:  # s8 where it is exact: the same grid, so the same products up to fp32 rounding
        assert _err(got["s8"][0], got["u8"][0])[1] < 1e-5 and _err(got["s8"][1], got["u8"][1])[1] < 1e-5


def test_ort_cpu_int8_weight_format_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    import lorad.kernels.ort_cpu as oc
    from lorad.kernels.capabilities import CpuFeature

    cases = [("x86_64", False, "u8"), ("AMD64", False, "u8"), ("x86_64", True, "s8"), ("aarch64", False, "s8")]
    for machine, vnni, want in cases:
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(oc, "cpu_int8", lambda v=vnni: CpuFeature(v, "test"))
        assert oc.int8_weight_format() == want, (machine, vnni)
    with pytest.raises(ValueError, match=r"weight_format must be one of .*'q8'"):
        oc.int8_graphs(4, 4, torch.ones(4).numpy(), None, weight_format="q8")


def test_torch_bf16_keeps_one_bf16_copy_for_both_directions() -> None:
    w, b, _, _ = _data()
    fl = make_frozen_linear(w, b, backend="torch", precision="bf16", name="probe")
    # One bf16 weight (2 bytes per element) plus the fp32 bias: no second copy for the input gradient.
    assert fl.nbytes == w.numel() * 2 + b.numel() * 4
    # Accumulation is fp32: summing 4096 products of bf16-exact operands is exact up to fp32 rounding, which a bf16
    # accumulator would not be (its error would be ~1e-2 relative here).
    k = 4096
    g = torch.Generator().manual_seed(1)
    wk = torch.randn(8, k, generator=g).bfloat16().float()
    xk = torch.randn(4, k, generator=g).bfloat16().float()
    fk = make_frozen_linear(wk, None, backend="torch", precision="bf16", name="acc")
    ref = (xk.double() @ wk.double().t()).float()
    assert torch.allclose(fk.forward(xk), ref, rtol=8e-3, atol=1e-2)


def test_torch_bf16_input_gradients_survive_the_row_counts_that_crash_onednn() -> None:
    """The oneDNN in torch 2.13 divides by zero in its AMX matmul blocking (SIGFPE: the process dies) for a transposed
    right operand with SmolLM2's head shape at 32 rows, [32, 49152]·W with W held column-major (as 2ea7ba9 held bf16
    weights; reverted). bf16 weights are held row-major; these shapes run in a child process, so a crash fails this
    test instead of killing the suite."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from lorad.kernels import make_frozen_linear\n"
        "torch.manual_seed(0)\n"
        "for out_f, in_f in ((49152, 576), (3072, 576), (576, 1536)):\n"
        "    fl = make_frozen_linear(torch.randn(out_f, in_f), None, backend='torch', precision='bf16')\n"
        "    assert fl._store['bf16'][0].is_contiguous()\n"
        "    for rows in (31, 32, 33, 64):\n"
        "        assert fl.input_grad(torch.randn(rows, out_f)).shape == (rows, in_f)\n"
        "        assert fl.forward(torch.randn(rows, in_f)).shape == (rows, out_f)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_torch_w8a8_one_int8_copy_native_gemm_equals_its_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    import lorad.kernels.torch_backend as tb
    from lorad.kernels.capabilities import CpuFeature, cpu_int8

    w, b, x, dy = _data(out_f=64, in_f=96, t=33)
    fl = make_frozen_linear(w, b, backend="torch", precision="w8a8", name="probe")
    # One int8 grid (1 byte per weight) with fp32 per-channel scales and bias serves both directions.
    assert fl.nbytes == w.numel() + 64 * 4 + b.numel() * 4
    y, dx = fl.forward(x), fl.input_grad(dy)
    monkeypatch.setattr(tb, "cpu_int8", lambda: CpuFeature(False, "test: emulate"))
    y_emu, dx_emu = fl.forward(x), fl.input_grad(dy)
    # The int8 GEMM accumulates exactly in int32, the emulation in fp32: equal up to fp32 rounding of the sums.
    assert _err(y, y_emu)[1] < 1e-6 and _err(dx, dx_emu)[1] < 1e-6
    if cpu_int8().native:  # the real path really is int8: its rounding grid differs from fp32 by the 8-bit error
        assert 1e-4 < _err(y - b, x @ w.t())[1] <= REL_TOL["w8a8"]
    # The input gradient folds the weight scale into dy before quantizing, as the ort-cpu w8a8 graphs do.
    ort = make_frozen_linear(w, b, backend="ort-cpu", precision="w8a8", name="ort")
    assert _err(dx, ort.input_grad(dy))[1] < REL_TOL["w8a8"] / 2


def test_weight_quantization_in_row_blocks_equals_the_whole_tensor_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorad.kernels import _quant

    monkeypatch.setattr(_quant, "_QUANT_CHUNK_ELEMENTS", 3 * 16)  # blocks of 3 rows: the last block is partial
    w = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
    w[4] = 0.0  # an all-zero row keeps its 1e-30 floor
    before = w.clone()
    for bits in (8, 4):
        qmax = 2 ** (bits - 1) - 1
        scale = w.abs().amax(dim=1).clamp_min(1e-30) / qmax
        q, s = _quant.quantize_weight(w, bits)
        assert torch.equal(s, scale)
        assert torch.equal(q, torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8))
    assert torch.equal(w, before)  # an fp32 weight is divided in a copy, never in place
