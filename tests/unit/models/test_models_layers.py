"""Hand-written backward passes agree with autograd on the plain formulas (float64 gradcheck)."""

from __future__ import annotations

import torch

from lorad.server.engine.models.layers import _RMSNorm, _SwiGLU, linear_cross_entropy


def test_rmsnorm_gradcheck() -> None:
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(8, dtype=torch.float64) + 0.5
    assert torch.autograd.gradcheck(lambda t: _RMSNorm.apply(t, w, 1e-5), (x,))


def test_swiglu_gradcheck() -> None:
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (g, u))


class _Head:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return dy @ self.w


def test_linear_cross_entropy_matches_full_logits() -> None:
    w = torch.randn(50, 8)
    h = torch.randn(13, 8, requires_grad=True)
    labels = torch.randint(0, 50, (13,))
    labels[[0, 4]] = -100
    for reduction in ("mean", "sum"):
        loss = linear_cross_entropy(h, labels, _Head(w), chunk=4, reduction=reduction)
        (gh,) = torch.autograd.grad(2.0 * loss, h)
        ref = torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction=reduction)
        (gr,) = torch.autograd.grad(2.0 * ref, h)
        assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(gh, gr, atol=1e-5)
    none = linear_cross_entropy(h, torch.full((13,), -100), _Head(w))
    assert float(none) == 0.0
