"""LoRALinear and FrozenMatmul against plain torch.autograd, on the torch reference backend."""

from __future__ import annotations

import threading

import pytest
import torch

from lorad.kernels import FrozenMatmul, LoRALinear, NpuQueue, make_frozen_linear


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bb: torch.Tensor, s: float):
    y = x @ w.t() + (0 if b is None else b)
    return y + s * (x @ a.t()) @ bb.t()


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_matches_autograd(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 20, generator=g)
    b = torch.randn(12, generator=g) if bias else None
    m = LoRALinear(make_frozen_linear(w, b, backend="torch"), rank=4, alpha=8.0)
    with torch.no_grad():
        m.lora_B.normal_(generator=g)  # B starts at zero; make it nonzero so dA and dX's LoRA share are exercised
    x = torch.randn(3, 5, 20, generator=g, requires_grad=True)
    dy = torch.randn(3, 5, 12, generator=g)
    y = m(x)
    (y * dy).sum().backward()

    a_ref = m.lora_A.detach().clone().requires_grad_()
    b_ref = m.lora_B.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = _reference(x_ref, w, b, a_ref, b_ref, m.scaling)
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.lora_A.grad, a_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.lora_B.grad, b_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp32", "w8a8"])
def test_bf16_rows_are_kept_as_they_came_and_give_what_their_widened_copy_gives(precision: str) -> None:
    """The bf16 attention hands o_proj bf16 rows: the node saves that tensor (not an fp32 copy of twice the bytes),
    and outputs and gradients are those of the same rows widened to fp32, bit for bit (the input gradient rounded to
    the input's bf16 by autograd)."""
    g = torch.Generator().manual_seed(5)
    m = LoRALinear(make_frozen_linear(torch.randn(12, 20, generator=g), None, backend="torch", precision=precision),
                   rank=4, alpha=8.0)  # fmt: skip
    with torch.no_grad():
        m.lora_B.normal_(generator=g)
    rows = torch.randn(1, 5, 20, generator=g).to(torch.bfloat16)
    dy = torch.randn(1, 5, 12, generator=g)

    def run(x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = x.detach().requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = m(x)
        (y * dy).sum().backward()
        out = [y.detach(), x.grad.to(torch.bfloat16), m.lora_A.grad, m.lora_B.grad]  # type: ignore[union-attr]
        m.lora_A.grad = m.lora_B.grad = None
        return out, [t for t in saved if t.shape == (5, 20)]

    got, kept = run(rows)
    want, kept_fp32 = run(rows.float())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), precision
    assert [t.dtype for t in kept] == [torch.bfloat16] and [t.dtype for t in kept_fp32] == [torch.float32]


def test_lora_init_like_peft() -> None:
    m = LoRALinear(make_frozen_linear(torch.randn(6, 10), None, backend="torch"), rank=2, alpha=4.0)
    assert m.scaling == 2.0
    assert m.lora_A.shape == (2, 10) and m.lora_B.shape == (6, 2)
    assert torch.count_nonzero(m.lora_B) == 0
    bound = 1.0 / 10**0.5  # kaiming_uniform(a=sqrt(5)) on fan_in=10
    assert 0 < m.lora_A.abs().max() <= bound


def test_rank_zero_is_frozen_only_but_differentiable() -> None:
    w = torch.randn(7, 9)
    m = LoRALinear(make_frozen_linear(w, None, backend="torch"), rank=0, alpha=1.0)
    assert list(m.parameters()) == []
    x = torch.randn(4, 9, requires_grad=True)
    m(x).pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (x_ref @ w.t()).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_dropout_gradients_use_the_same_mask() -> None:
    torch.manual_seed(1)
    w = torch.randn(5, 8)
    m = LoRALinear(make_frozen_linear(w, None, backend="torch"), rank=3, alpha=3.0, dropout=0.5)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(6, 8, requires_grad=True)
    torch.manual_seed(2)
    y = m(x)
    y.sum().backward()
    # Rebuild the mask from the same RNG state and differentiate the reference.
    torch.manual_seed(2)
    mask = torch.empty(6, 8).bernoulli_(0.5) / 0.5
    x_ref = x.detach().clone().requires_grad_()
    a = m.lora_A.detach().clone().requires_grad_()
    b = m.lora_B.detach().clone().requires_grad_()
    y_ref = x_ref @ w.t() + m.scaling * ((x_ref * mask) @ a.t()) @ b.t()
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(m.lora_A.grad, a.grad)
    m.eval()
    torch.testing.assert_close(m(x), x @ w.t() + m.scaling * (x @ m.lora_A.t()) @ m.lora_B.t())


def test_frozen_calls_run_on_the_queue_worker() -> None:
    seen: list[str] = []
    inner = make_frozen_linear(torch.randn(4, 4), None, backend="torch")

    class Spy:
        in_features, out_features, name = 4, 4, "spy"
        precision_fwd = precision_bwd = "fp32"
        nbytes = inner.nbytes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return inner.forward(x)

        def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return inner.input_grad(dy)

    q = NpuQueue(name="spyq")
    x = torch.randn(2, 4, requires_grad=True)
    FrozenMatmul.apply(x, Spy(), q).sum().backward()
    LoRALinear(Spy(), 2, 2.0, queue=q)(x).sum().backward()
    assert len(seen) == 4 and all(n.startswith("spyq") for n in seen)
    # A submit from the worker itself runs inline instead of deadlocking.
    assert q.submit(lambda: q.submit(lambda: 7).result()).result(timeout=5) == 7
    q.shutdown()


def test_cpu_backends_run_inline_npu_backends_on_the_worker() -> None:
    from lorad.kernels.queue import default_queue, queue_for

    m = LoRALinear(make_frozen_linear(torch.randn(4, 4), None, backend="torch"), 2, 2.0)
    assert m.queue.inline and queue_for(m.frozen) is m.queue
    seen: list[str] = []
    m.frozen.forward = lambda x, f=m.frozen.forward: seen.append(threading.current_thread().name) or f(x)
    m(torch.randn(3, 4))
    assert seen == [threading.current_thread().name]
    assert not queue_for(object()).inline and queue_for(object()) is default_queue()
