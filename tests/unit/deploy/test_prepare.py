"""`lorad prepare`: SoC table, manifest checks, and a real bundle built and loaded on the HTP simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorad.server.engine.prepare import (
    BundleError,
    BundleMismatchError,
    model_hash_of_folder,
    prepare_main,
    resolve_soc,
)
from lorad.server.engine.prepare.manifest import GraphEntry, Manifest, ResolvedPlan, sha256_file, write_manifest
from tests.fixtures.tiny_hf import save_tiny_hf


@pytest.mark.parametrize(
    ("name", "chip", "soc_model", "arch"),
    [
        ("8 Gen 1", "SM8450", "36", "69"), ("Snapdragon 8+ Gen 1", "SM8475", "42", "69"),
        ("8 Gen 2", "SM8550", "43", "73"), ("sm8650", "SM8650", "57", "75"),
        ("snapdragon-8-gen-3", "SM8650", "57", "75"),
        ("8 Elite", "SM8750", "69", "79"), ("8 Elite Gen 5", "SM8850", "87", "81"), ("8s Gen 3", "SM8635", "68", "73"),
    ],
)  # fmt: skip
def test_resolve_soc(name: str, chip: str, soc_model: str, arch: str) -> None:
    t = resolve_soc(name)
    assert (t.chip, t.soc_model, t.htp_arch) == (chip, soc_model, arch)


def test_unknown_soc_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="SM8650 = Snapdragon 8 Gen 3"):
        resolve_soc("Dimensity 9300")


def test_cli_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare_main(["--soc", "8 Gen 3"]) == 2
    assert "missing --model, --out" in capsys.readouterr().err
    assert prepare_main(["--list-socs"]) == 0
    assert "SM8750" in capsys.readouterr().out


def test_frozen_linear_names_match_build_model(tmp_path: Path) -> None:
    from lorad.server.engine.models.build import build_model
    from lorad.server.engine.models.hf_folder import read_config, read_weights
    from lorad.server.engine.models.model import Linear
    from lorad.server.engine.prepare.build import frozen_linears

    folder = save_tiny_hf(tmp_path / "m", "qwen2")
    cfg, weights = read_config(folder), read_weights(folder)
    model = build_model(cfg, weights, backend="torch")
    built = [(m.name, tuple(m.frozen.bias is not None for _ in [0])) for m in model.modules() if isinstance(m, Linear)]
    ours = [(s.name, (s.bias is not None,)) for s in frozen_linears(cfg, weights)]
    assert sorted(ours) == sorted(built)
    assert len(ours) == 7 * cfg.num_layers + 1


def _fake_bundle(root: Path, **over: object) -> Manifest:
    """A bundle with one small file and a hand-written manifest (no QNN needed)."""
    from lorad.server.engine.prepare.build import versions

    (root / "contexts").mkdir(parents=True)
    f = root / "contexts/a_ctx.onnx"
    f.write_bytes(b"graph bytes")
    fields: dict[str, object] = dict(
        model_hash="a" * 64, model_name="tiny", model_arch="qwen2", soc_chip="SM8650", soc_name="Snapdragon 8 Gen 3",
        soc_model="57", htp_arch="75", buckets=(32,), plan=ResolvedPlan({"lm_head": ("fp16", "fp16")}),
        graphs=(GraphEntry("lm_head", "fwd", 32, "fp16", "contexts/a_ctx.onnx", f.stat().st_size, sha256_file(f)),),
        created_at="2026-01-01T00:00:00+00:00", host="x86_64", **versions(),
    )  # fmt: skip
    fields.update(over)
    m = Manifest(**fields)  # type: ignore[arg-type]
    write_manifest(root, m)
    return m


def test_manifest_round_trip(tmp_path: Path) -> None:
    m = _fake_bundle(tmp_path / "b")
    assert Manifest.from_json((tmp_path / "b/manifest.json").read_text()) == m


def test_refuses_other_model_other_soc_other_runtime_and_corruption(tmp_path: Path) -> None:
    from lorad.server.engine.prepare.load import load_bundle

    root = tmp_path / "b"
    _fake_bundle(root)
    ok = load_bundle(root, model_hash="a" * 64, soc_model="57", htp_arch="75")
    assert ok.buckets == (32,) and ok.plan.for_layer("lm_head") == ("fp16", "fp16")
    with pytest.raises(BundleMismatchError, match=r"prepared for model 'tiny' \(hash aaaaaaaaaaaa\).*bbbbbbbbbbbb"):
        load_bundle(root, model_hash="b" * 64, soc_model="57", htp_arch="75")
    with pytest.raises(BundleMismatchError, match=r"Snapdragon 8 Gen 3 \(SM8650.*this device is Snapdragon 8 Elite"):
        load_bundle(root, model_hash="a" * 64, soc_model="69", htp_arch="79")
    with pytest.raises(BundleMismatchError, match="--soc SM8750"):
        load_bundle(root, model_hash="a" * 64, soc_model="69", htp_arch="79")
    stale = tmp_path / "stale"
    _fake_bundle(stale, onnxruntime_version="0.0.1")
    with pytest.raises(BundleMismatchError, match=r"onnxruntime_version 0\.0\.1 \(bundle\)"):
        load_bundle(stale, model_hash="a" * 64, soc_model="57", htp_arch="75")
    (root / "contexts/a_ctx.onnx").write_bytes(b"graph BYTES")  # same size, other content
    with pytest.raises(BundleError, match="sha256 differs"):
        load_bundle(root, model_hash="a" * 64, soc_model="57", htp_arch="75")
    (root / "contexts/a_ctx.onnx").unlink()
    with pytest.raises(BundleError, match=r"missing contexts/a_ctx\.onnx"):
        load_bundle(root, model_hash="a" * 64, soc_model="57", htp_arch="75")
    with pytest.raises(BundleError, match=r"manifest\.json is missing"):
        load_bundle(tmp_path, model_hash="a" * 64, soc_model="57", htp_arch="75")
    bad = json.loads((root / "manifest.json").read_text())
    bad["format_version"] = 99
    (root / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(BundleError, match="format version 99"):
        load_bundle(root, model_hash="a" * 64, soc_model="57", htp_arch="75")


def test_model_hash_changes_with_weights(tmp_path: Path) -> None:
    a, b = save_tiny_hf(tmp_path / "a", "qwen2", seed=0), save_tiny_hf(tmp_path / "b", "qwen2", seed=1)
    assert model_hash_of_folder(a) == model_hash_of_folder(save_tiny_hf(tmp_path / "a2", "qwen2", seed=0))
    assert model_hash_of_folder(a) != model_hash_of_folder(b)


# ---- on the HTP simulator -------------------------------------------------------------------------------------
BUCKET = 32  # tokens; tiny graphs (<= 32x128x256) build in ~0.05 s each on the simulator


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from lorad.kernels.qnn_htp import htp_unavailable_reason

    reason = htp_unavailable_reason()
    if reason:
        pytest.skip(f"QNN HTP EP unavailable: {reason}")
    tmp = tmp_path_factory.mktemp("prepare")
    model = save_tiny_hf(tmp / "tiny", "qwen2")
    bundle = tmp / "bundle-sm8650"
    rc = prepare_main(["--model", str(model), "--soc", "8 Gen 3", "--out", str(bundle), "--bucket", str(BUCKET)])
    assert rc == 0
    return model, bundle


@pytest.mark.htp
def test_bundle_layout(prepared: tuple[Path, Path]) -> None:
    model, bundle = prepared
    m = Manifest.from_json((bundle / "manifest.json").read_text())
    assert (m.soc_chip, m.soc_model, m.htp_arch, m.buckets) == ("SM8650", "57", "75", (BUCKET,))
    assert m.model_hash == model_hash_of_folder(model)
    assert len(m.graphs) == (7 * 2 + 1) * 2  # every linear, forward and input gradient
    assert {(g.direction, g.bucket) for g in m.graphs} == {("fwd", BUCKET), ("bwd", BUCKET)}
    for g in m.graphs:
        assert sha256_file(bundle / g.file) == g.sha256
    # Layers of one shape share one weight-free fp16 graph; every file in contexts/ is listed.
    assert {g.file for g in m.graphs} == {f"contexts/{p.name}" for p in (bundle / "contexts").iterdir()}
    assert not list(bundle.parent.glob(".bundle-sm8650.tmp-*")), "temp build dir left behind"
    assert prepare_main(["--model", str(model), "--soc", "8 Gen 3", "--out", str(bundle)]) == 1  # exists, no --force


@pytest.mark.htp
def test_bundle_loads_on_the_simulator_and_matches_a_fresh_build(
    prepared: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorad.kernels import make_frozen_linear
    from lorad.server.engine.models.hf_folder import read_config, read_weights
    from lorad.server.engine.prepare.build import frozen_linears
    from lorad.server.engine.prepare.load import load_bundle, open_frozen_linears

    model, bundle_dir = prepared
    # The simulator stands in for the phone: it reports the bundle's SoC through the kernels' override.
    monkeypatch.setenv("LORAD_QNN_SOC_MODEL", "57")
    monkeypatch.setenv("LORAD_QNN_HTP_ARCH", "75")
    bundle = load_bundle(bundle_dir, model_hash=model_hash_of_folder(model))
    loaded = open_frozen_linears(bundle, model)  # raises if any graph had to be built
    sources = [how for lin in loaded.values() for how in lin.sources.values()]
    assert set(sources) <= {"cache", "shared"} and "cache" in sources, sources  # nothing built
    from lorad.server.engine.prepare.build import fresh_session_pool

    fresh_session_pool()  # the fresh builds below must build, not reuse the bundle's pooled sessions
    specs = {s.name: s for s in frozen_linears(read_config(model), read_weights(model))}
    g = torch.Generator().manual_seed(0)
    for name, lin in loaded.items():
        spec = specs[name]
        w = spec.weight.float()
        b = None if spec.bias is None else spec.bias.float()
        fresh = make_frozen_linear(w, b, backend="qnn-htp", precision="fp16", name=name, buckets=(BUCKET,))
        fresh.warmup()
        assert "cache" not in fresh.sources.values()
        x = torch.randn(BUCKET - 3, w.shape[1], generator=g)  # a partial bucket: padding is stripped
        dy = torch.randn(BUCKET - 3, w.shape[0], generator=g)
        assert torch.equal(lin.forward(x), fresh.forward(x)), name
        assert torch.equal(lin.input_grad(dy), fresh.input_grad(dy)), name
        ref = x @ w.t() + (0 if b is None else b)
        assert float((lin.forward(x) - ref).abs().max() / ref.abs().max()) < 5e-3, name  # fp16 tolerance
        assert float((lin.input_grad(dy) - dy @ w).abs().max() / (dy @ w).abs().max()) < 5e-3, name


@pytest.mark.htp
def test_loaded_bundle_refused_for_other_soc_or_model(
    prepared: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lorad.server.engine.prepare.load import load_bundle

    model, bundle_dir = prepared
    monkeypatch.setenv("LORAD_QNN_SOC_MODEL", "69")  # the device is an 8 Elite
    monkeypatch.setenv("LORAD_QNN_HTP_ARCH", "79")
    with pytest.raises(BundleMismatchError, match=r"prepared for Snapdragon 8 Gen 3.*device is Snapdragon 8 Elite"):
        load_bundle(bundle_dir, model_hash=model_hash_of_folder(model))
    monkeypatch.setenv("LORAD_QNN_SOC_MODEL", "57")
    monkeypatch.setenv("LORAD_QNN_HTP_ARCH", "75")
    other = save_tiny_hf(tmp_path / "other", "qwen2", seed=1)
    with pytest.raises(BundleMismatchError, match="prepared for model 'qwen2'"):
        load_bundle(bundle_dir, model_hash=model_hash_of_folder(other))


@pytest.mark.htp
def test_cli_check_compares_with_fresh_builds(prepared: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, bundle = prepared
    assert prepare_main(["--check-only", str(bundle), "--model", str(model), "--check-limit", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["check"]["graphs"] == 6 and out["check"]["max_abs_diff"] == 0.0
