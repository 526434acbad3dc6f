"""ORT CPU sessions are weight-free, so same-shaped frozen linears share one session and still compute their own W."""

import gc

import torch

from lorad.kernels import make_frozen_linear, ort_cpu


def test_same_shape_linears_share_sessions_and_keep_their_own_weights() -> None:
    gc.collect()
    before = ort_cpu.pooled_sessions()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(48, 32, generator=g) for _ in range(3)]
    lins = [make_frozen_linear(w, None, backend="ort-cpu", precision="fp32", name=f"l{i}") for i, w in enumerate(ws)]
    x, dy = torch.randn(5, 32, generator=g), torch.randn(5, 48, generator=g)
    for w, lin in zip(ws, lins, strict=True):
        torch.testing.assert_close(lin.forward(x), x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.input_grad(dy), dy @ w, rtol=1e-5, atol=1e-5)
    # Three linears, one forward and one input-gradient graph between them.
    assert ort_cpu.pooled_sessions() - before == 2
    del lins, lin
    gc.collect()
    assert ort_cpu.pooled_sessions() == before  # sessions die with the last linear that uses them
