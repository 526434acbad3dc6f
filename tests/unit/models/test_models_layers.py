"""Hand-written backward passes agree with autograd on the plain formulas (float64 gradcheck)."""

from __future__ import annotations

import pytest
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


class _BiasedHead(_Head):
    """A head whose padded (zero) rows give nonzero logits, recording the row counts it is called with."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__(w)
        self.bias = torch.linspace(-1.0, 1.0, w.shape[0])
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return x @ self.w.t() + self.bias

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        self.rows.append(dy.shape[0])
        return dy @ self.w


def test_linear_cross_entropy_pads_a_short_last_chunk_to_a_multiple_of_16_rows() -> None:
    # oneDNN compiles (and keeps) a GEMM per row count; padded, four sizes serve every batch. The head's bias makes
    # the padding rows' logits nonzero: they must not reach the loss or the gradient.
    w = torch.randn(50, 8)
    h = torch.randn(110, 8, requires_grad=True)
    labels = torch.randint(0, 50, (110,))
    labels[:10] = -100  # 100 labelled rows: one chunk of 64, then 36 padded to 48
    head = _BiasedHead(w)
    loss = linear_cross_entropy(h, labels, head, chunk=64)
    (gh,) = torch.autograd.grad(loss, h)
    assert head.rows == [64, 64, 48, 48]
    ref = torch.nn.functional.cross_entropy(h @ w.t() + head.bias, labels)
    (gr,) = torch.autograd.grad(ref, h)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, gr, rtol=1e-5, atol=1e-6)


def _rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RoPE of x [B, H, T, D] by plain autograd ops: the reference."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("bf16", [True, False])
def test_rope_heads_are_hf_rope_rounded_once_and_their_gradient_is_autograds(bf16: bool) -> None:
    """The attention's fused RoPE: the rotation of x [B, T, H, D] as [B, H, T, D] heads equals Hugging Face's
    rotate-half result (fp32, or rounded to bf16 once: up to one bf16 step where an FMA rounds differently), and its
    input gradient equals autograd's through that reference, in the [B, T, H, D] layout, contiguous."""
    from lorad.server.engine.models.layers import rope_heads

    gen = torch.Generator().manual_seed(11)
    t, d = 13, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(t).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = torch.randn(2, t, 3, d, generator=gen, requires_grad=True)
    g = torch.randn(2, 3, t, d, generator=gen).to(torch.bfloat16 if bf16 else torch.float32)

    ref = _rotate_half_rope(x.transpose(1, 2), cos, sin)
    (ref_grad,) = torch.autograd.grad(ref, x, g.float())
    out = rope_heads(x, cos, sin, bf16=bf16)
    (grad,) = torch.autograd.grad(out, x, g)
    assert out.dtype == g.dtype and out.shape == (2, 3, t, d) and out.is_contiguous()
    expected = ref.detach().to(torch.bfloat16).float() if bf16 else ref.detach()
    torch.testing.assert_close(out.float(), expected, rtol=8e-3 if bf16 else 1e-6, atol=1e-6)
    assert grad.dtype == torch.float32 and grad.shape == x.shape and grad.is_contiguous()
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)


def test_a_bf16_head_multiplies_each_block_once_with_the_chunked_losss_numbers() -> None:
    """A torch bf16 lm_head runs one GEMM per direction for up to 256 labelled rows (the weight streamed twice per
    block, not per 64-row chunk) and keeps the block's bf16 logits for the gradient; loss and gradient equal the
    chunk-by-chunk path through the same layer."""
    from lorad.kernels import make_frozen_linear

    gen = torch.Generator().manual_seed(12)
    head = make_frozen_linear(torch.randn(300, 32, generator=gen), None, backend="torch", precision="bf16")
    h = torch.randn(120, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 300, (120,), generator=gen)
    labels[:10] = -100  # 110 labelled rows: one block (softmax over 16 rows at a time); 64 + 46 chunk by chunk

    class _Opaque:  # the same layer behind an object the loss cannot see through: the chunk-by-chunk path
        in_features, out_features = 32, 300
        forward, input_grad = head.forward, head.input_grad

    rows: list[int] = []
    blocks: list[int] = []
    real = head.bf16_product

    def counted(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(x.shape[0])
        if out is not None:
            blocks.append(out.untyped_storage().nbytes() // (300 * 2))
        return real(x, out=out)

    head.bf16_product = counted  # type: ignore[method-assign]
    loss = linear_cross_entropy(h, labels, head, chunk=64)
    (gh,) = torch.autograd.grad(loss, h)
    # the GEMM runs on the rows padded to 16, into a logits block allocated at a multiple of 64 rows: four block sizes
    # a run, not one per labelled count
    assert rows == [112] and blocks == [128]
    loss_ref = linear_cross_entropy(h, labels, _Opaque(), chunk=64)  # type: ignore[arg-type]
    (gr,) = torch.autograd.grad(loss_ref, h)
    assert rows == [112, 64, 48]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, gr, rtol=1e-6, atol=1e-7)
