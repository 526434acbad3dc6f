"""Load a prepared QNN context bundle on the device: refuse a foreign model, SoC or runtime; build nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from lorad.server.engine.prepare.build import DIRECTIONS, fresh_session_pool, frozen_linears, targeting, versions
from lorad.server.engine.prepare.manifest import (
    CONTEXTS,
    BundleError,
    BundleMismatchError,
    Manifest,
    ResolvedPlan,
    read_manifest,
    verify_files,
)
from lorad.server.engine.prepare.socs import SocTarget, describe_options, soc_for_options

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: pass ``contexts_dir``, ``model_hash``, ``buckets`` and ``plan`` to the qnn-htp kernels."""

    root: Path
    manifest: Manifest

    @property
    def contexts_dir(self) -> Path:
        """The kernels' EP-context cache directory inside the bundle."""
        return self.root / CONTEXTS

    @property
    def model_hash(self) -> str:
        """Base-model hash the graphs are keyed by."""
        return self.manifest.model_hash

    @property
    def buckets(self) -> tuple[int, ...]:
        """Token buckets the graphs were built for."""
        return self.manifest.buckets

    @property
    def plan(self) -> ResolvedPlan:
        """Per-layer precisions (``for_layer(name) -> (fwd, bwd)``)."""
        return self.manifest.plan

    @property
    def target(self) -> SocTarget:
        """The SoC the bundle was compiled for."""
        m = self.manifest
        return soc_for_options(m.soc_model, m.htp_arch) or SocTarget(m.soc_chip, m.soc_name, m.soc_model, m.htp_arch)


def _device_soc() -> tuple[str, str, str]:
    """(soc_model, htp_arch, why-unusable) exactly as the qnn-htp kernels will compile and key graphs here.

    detect_backend() caches its probe for the process; the kernels read the SoC per session (kernels.detect._soc,
    /sys soc_id or the LORAD_QNN_SOC_MODEL / LORAD_QNN_HTP_ARCH override), so ask the same function.
    """
    from lorad.kernels.detect import _soc
    from lorad.kernels.qnn_htp import htp_unavailable_reason

    reason = htp_unavailable_reason()
    if reason:
        return "", "", reason
    soc, arch = _soc()
    return soc, arch, ""


def load_bundle(
    root: Path, *, model_hash: str, soc_model: str | None = None, htp_arch: str | None = None, full_verify: bool = True
) -> Bundle:
    """Open ``root`` for this model and device, or refuse with a message that says what to do.

    Args:
        root: bundle directory written by `lorad prepare`.
        model_hash: hash of the base model the daemon loaded (model_hash_of_folder of its folder).
        soc_model: the device's QNN soc_model; None asks lorad.kernels.detect (this device).
        htp_arch: the device's HTP arch; None asks lorad.kernels.detect.
        full_verify: check every file's sha256 (else only sizes).

    Returns:
        The verified Bundle.

    Raises:
        BundleMismatchError: the bundle was prepared for another model, SoC, onnxruntime or onnxruntime-qnn.
        BundleError: the bundle is missing, malformed or corrupt.
    """
    m = read_manifest(root)
    if m.model_hash != model_hash:
        raise BundleMismatchError(
            f"QNN bundle {root} was prepared for model {m.model_name!r} (hash {m.model_hash[:12]}), but the "
            f"daemon's base model has hash {model_hash[:12]}; run `lorad prepare --model <this model's folder> "
            f"--soc {m.soc_chip} --out <dir>` on a host and copy the new bundle"
        )
    if soc_model is None or htp_arch is None:
        dev_soc, dev_arch, status = _device_soc()
        soc_model, htp_arch = soc_model or dev_soc, htp_arch or dev_arch
        if not soc_model:
            raise BundleMismatchError(
                f"QNN bundle {root} needs the QNN HTP backend, which is not usable here: {status}"
            )
    if (m.soc_model, m.htp_arch) != (soc_model, htp_arch):
        want = soc_for_options(soc_model, htp_arch)
        raise BundleMismatchError(
            f"QNN bundle {root} was prepared for {describe_options(m.soc_model, m.htp_arch)}, but this device is "
            f"{describe_options(soc_model, htp_arch)}; run `lorad prepare --soc "
            f"{want.chip if want else '<this device>'} ...` on a host (context binaries are SoC-specific)"
        )
    here = versions()
    stale = [
        f"{k} {getattr(m, k)} (bundle) vs {here[k]} (here)"
        for k in ("onnxruntime_version", "onnxruntime_qnn_version")
        if getattr(m, k) != here[k]
    ]
    if stale:
        raise BundleMismatchError(
            f"QNN bundle {root} was built with other runtime versions: {'; '.join(stale)}; context binaries are "
            "tied to the QNN SDK version: re-run `lorad prepare` with the versions installed on the device"
        )
    verify_files(root, m.graphs, full=full_verify)
    log.info("bundle_loaded", root=str(root), soc=m.soc_chip, graphs=len(m.graphs), model_hash=m.model_hash[:12])
    return Bundle(root, m)


def open_frozen_linears(bundle: Bundle, model_dir: Path) -> dict[str, Any]:
    """Create every frozen linear of the model on qnn-htp from the bundle's contexts (no graph is built).

    Args:
        bundle: a Bundle from load_bundle (model and SoC already checked).
        model_dir: the model folder (the host weights of fp16 graphs, which take the weight as an input).

    Layers of one shape share one weight-free fp16 graph (the kernels' session pool): the first loads it from the
    bundle ("cache"), the others reuse it ("shared"). The pool is emptied first so no session made elsewhere
    (another SoC target or cache) is reused.

    Returns:
        layer name -> FrozenLinear, in build_model's order.

    Raises:
        BundleError: some graph was not in the bundle and had to be built (lists them).
    """
    from lorad.kernels import make_frozen_linear
    from lorad.server.engine.models.hf_folder import read_config, read_weights

    cfg = read_config(model_dir)
    weights = read_weights(model_dir)
    out: dict[str, Any] = {}
    rebuilt: list[str] = []
    fresh_session_pool()
    for spec in frozen_linears(cfg, weights):
        fwd, bwd = bundle.plan.for_layer(spec.name)
        lin: Any = make_frozen_linear(
            spec.weight.to(torch.float32), None if spec.bias is None else spec.bias.to(torch.float32),
            backend="qnn-htp", precision=fwd, precision_bwd=bwd, name=spec.name, cache_dir=bundle.contexts_dir,
            model_hash=bundle.model_hash, buckets=bundle.buckets,
        )  # fmt: skip
        lin.warmup()
        rebuilt += [f"{spec.name} {d} T={t}" for (d, t), how in lin.sources.items() if how not in ("cache", "shared")]
        out[spec.name] = lin
    if rebuilt:
        raise BundleError(f"bundle {bundle.root} lacks {len(rebuilt)} graphs that had to be built: {rebuilt[:5]}")
    return out


def check_bundle(root: Path, model_dir: Path, *, limit: int | None = None, seed: int = 0) -> dict[str, float]:
    """On a host: load the bundle on the local HTP (the simulator on x86) and compare with fresh builds.

    Every linear (or the first ``limit``) runs forward and input-gradient on the same random inputs from the
    bundle's contexts and from a freshly built session; the outputs must agree.

    Returns:
        ``{"graphs": n, "max_abs_diff": d, "max_ref": r}``.

    Raises:
        BundleError / BundleMismatchError: the bundle does not load (see load_bundle, open_frozen_linears).
    """
    from lorad.kernels import make_frozen_linear
    from lorad.server.engine.models.hf_folder import read_config, read_weights
    from lorad.server.engine.prepare.manifest import model_hash_of_folder

    m = read_manifest(root)
    target = soc_for_options(m.soc_model, m.htp_arch) or SocTarget(m.soc_chip, m.soc_name, m.soc_model, m.htp_arch)
    with targeting(target):  # the simulator stands in for the target SoC
        bundle = load_bundle(root, model_hash=model_hash_of_folder(model_dir), soc_model=m.soc_model,
                             htp_arch=m.htp_arch)  # fmt: skip
        loaded = open_frozen_linears(bundle, model_dir)
        specs = {s.name: s for s in frozen_linears(read_config(model_dir), read_weights(model_dir))}
        fresh_session_pool()  # the fresh builds below must not reuse the bundle's pooled sessions
        g = torch.Generator().manual_seed(seed)
        worst, ref_max, n = 0.0, 0.0, 0
        for name in list(loaded)[:limit]:
            spec, lin = specs[name], loaded[name]
            fwd, bwd = bundle.plan.for_layer(name)
            fresh: Any = make_frozen_linear(
                spec.weight.to(torch.float32), None if spec.bias is None else spec.bias.to(torch.float32),
                backend="qnn-htp", precision=fwd, precision_bwd=bwd, name=name, cache_dir=None,
                buckets=bundle.buckets,
            )  # fmt: skip
            if "cache" in fresh.sources.values():
                raise BundleError(f"{name}: the fresh build came from a cache; the check would compare nothing")
            t = bundle.buckets[0]
            for direction in DIRECTIONS:
                width = lin.in_features if direction == "fwd" else lin.out_features
                a = torch.randn(t, width, generator=g)
                call = "forward" if direction == "fwd" else "input_grad"
                y_b, y_f = getattr(lin, call)(a), getattr(fresh, call)(a)
                worst = max(worst, float((y_b - y_f).abs().max()))
                ref_max = max(ref_max, float(np.abs(y_f.numpy()).max()))
                n += 1
    return {"graphs": n, "max_abs_diff": worst, "max_ref": ref_max}
