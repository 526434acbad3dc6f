"""Layer-wise overlapped AdamW equals plain AdamW; clipping modes; gradient accumulation equivalence."""

import pytest
import torch

from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.optim import LayerwiseAdamW, _clip_global
from tests.fixtures.tiny_lm import TinyLM, make_trainer

KW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (2, 24), generator=g)
        out.append((x, x.clone()))
    return out


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(layers=4)


def _run_layerwise(overlap: bool, max_norm: float, mode: str, steps: int = 4) -> tuple[TinyLM, list[int]]:
    m = _model()
    opt = LayerwiseAdamW(m.lora_groups(), max_grad_norm=max_norm, clip_mode=mode, overlap=overlap, **KW)
    early = []
    for x, y in _batches(steps):
        opt.arm(last_micro_step=True)
        m(x, y).backward()
        early.append(opt.finish().early_groups)
    opt.close()
    return m, early


def _run_reference(max_norm: float, steps: int = 4) -> TinyLM:
    m = _model()
    params = [p for _, ps in m.lora_groups() for p in ps]
    opt = torch.optim.AdamW(params, fused=True, **KW)
    for x, y in _batches(steps):
        m(x, y).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        opt.step()
        opt.zero_grad()
    return m


def _max_diff(a: TinyLM, b: TinyLM) -> float:
    sa, sb = a.lora_state_dict(), b.lora_state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def test_overlapped_equals_sequential_adamw_without_clipping() -> None:
    m, early = _run_layerwise(overlap=True, max_norm=0.0, mode="global")
    assert early == [4, 4, 4, 4]  # every layer stepped during the backward
    assert _max_diff(m, _run_reference(0.0)) == 0.0  # bit-identical


def test_global_clip_is_exact_and_not_early() -> None:
    m, early = _run_layerwise(overlap=True, max_norm=0.05, mode="global")
    assert early == [0, 0, 0, 0]
    # and nothing listens to the gradients: their hooks would be a no-op Python call per parameter every backward
    clipped = LayerwiseAdamW(m.lora_groups(), max_grad_norm=0.05, clip_mode="global", overlap=True, **KW)
    unclipped = LayerwiseAdamW(m.lora_groups(), max_grad_norm=0.0, clip_mode="global", overlap=True, **KW)
    assert clipped._hooks == [] and unclipped._hooks
    clipped.close()
    unclipped.close()
    ref = _run_reference(0.05)
    assert _max_diff(m, ref) < 1e-7
    assert _max_diff(ref, _run_reference(0.0)) > 1e-4  # the clip was active


@pytest.mark.parametrize("max_norm", [0.05, 1e6, float("nan")])
def test_global_clip_gives_torchs_bits_whether_or_not_it_clips(max_norm: float) -> None:
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 40, 257)]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    if max_norm != max_norm:  # NaN stands for a NaN gradient: torch spreads it to every gradient
        grads[1][5] = float("nan")
        max_norm = 1.0
    ours, theirs = [torch.nn.Parameter(torch.zeros(p.shape)) for p in params], params
    for a, b, gr in zip(ours, theirs, grads, strict=True):
        a.grad, b.grad = gr.clone(), gr.clone()
    norm = _clip_global(ours, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=True)
    torch.testing.assert_close(torch.tensor(norm), ref, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)


def test_global_clip_off_gives_plain_adamw_bits() -> None:
    m, early = _run_layerwise(overlap=True, max_norm=1e6, mode="global")
    assert early == [0, 0, 0, 0]
    assert _max_diff(m, _run_reference(0.0)) == 0.0  # a norm within the bound changes no gradient


def test_per_layer_clip_overlapped_equals_sequential() -> None:
    m1, early = _run_layerwise(overlap=True, max_norm=0.05, mode="per_layer")
    m2, early2 = _run_layerwise(overlap=False, max_norm=0.05, mode="per_layer")
    assert early == [4, 4, 4, 4] and early2 == [0, 0, 0, 0]
    assert _max_diff(m1, m2) == 0.0
    assert _max_diff(m1, _run_reference(0.0)) > 1e-4


def test_state_dict_roundtrip_and_group_check() -> None:
    m = _model()
    opt = LayerwiseAdamW(m.lora_groups(), max_grad_norm=0.0, clip_mode="global", overlap=True, **KW)
    x, y = _batches(1)[0]
    opt.arm(True)
    m(x, y).backward()
    opt.finish()
    sd = opt.state_dict()
    assert list(sd) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    opt2 = LayerwiseAdamW(_model().lora_groups(), max_grad_norm=0.0, clip_mode="global", overlap=True, **KW)
    for group_state in sd.values():  # as a checkpoint from before the fused kernel says
        for g in group_state["param_groups"]:
            g["fused"], g["foreach"] = None, True
    opt2.load_state_dict(sd)
    assert all(g["fused"] and not g["foreach"] for o in opt2._opts.values() for g in o.param_groups)
    with pytest.raises(ValueError, match="groups"):
        opt2.load_state_dict({"other": sd["layers.0"]})
    opt.close()
    opt2.close()


@pytest.mark.parametrize("clip_mode", ["global", "per_layer"])
def test_grad_accumulation_equals_bigger_batch(clip_mode: str) -> None:
    base = {
        "steps": 4,
        "seq_len": 32,
        "lr": 5e-3,
        "eval_fraction": 0.0,
        "max_grad_norm": 0.5,
        "clip_mode": clip_mode,
        "weight_decay": 0.01,
    }
    t_big = make_trainer(TrainConfig(batch_size=2, grad_accum=1, **base))
    t_acc = make_trainer(TrainConfig(batch_size=1, grad_accum=2, **base))
    r_big, r_acc = t_big.run(), t_acc.run()
    assert r_big.losses == pytest.approx(r_acc.losses, rel=1e-5)
    a, b = t_big.model.lora_state_dict(), t_acc.model.lora_state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
