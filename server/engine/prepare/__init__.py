"""QNN context bundles: `lorad prepare` builds them on a host for a target SoC; the daemon loads them on the phone.

Public surface:
- ``prepare_main(argv)``: the `lorad prepare` command.
- ``build_bundle(model_dir, target, out, ...)``: build every frozen linear's EP-context graphs into a bundle.
- ``load_bundle(root, model_hash=...)``: open a bundle on the device; ``BundleMismatchError`` for another model,
  SoC or runtime version, ``BundleError`` for a corrupt one. ``Bundle.contexts_dir / model_hash / buckets / plan``
  are what the qnn-htp kernels need (``cache_dir``, ``model_hash``, ``buckets``, ``precision``).
- ``open_frozen_linears(bundle, model_dir)``: all frozen linears from the bundle, refusing any rebuilt graph.
- ``check_bundle(root, model_dir)``: host-side check on the HTP simulator against fresh builds.
- ``SOCS``, ``resolve_soc(name)``: Snapdragon name / part number -> QNN soc_model and htp_arch.
- ``model_hash_of_folder(folder)``: the model hash bundles are keyed by.
"""

from lorad.server.engine.prepare.cli import prepare_main
from lorad.server.engine.prepare.manifest import BundleError, BundleMismatchError, Manifest, model_hash_of_folder
from lorad.server.engine.prepare.socs import SOCS, SocTarget, resolve_soc


def __getattr__(name: str) -> object:
    # build/load import torch and the kernels; keep `import lorad.server.engine.prepare` (and --list-socs) light.
    if name in ("build_bundle",):
        from lorad.server.engine.prepare import build

        return getattr(build, name)
    if name in ("Bundle", "load_bundle", "open_frozen_linears", "check_bundle"):
        from lorad.server.engine.prepare import load

        return getattr(load, name)
    raise AttributeError(name)


__all__ = [
    "SOCS",
    "Bundle",
    "BundleError",
    "BundleMismatchError",
    "Manifest",
    "SocTarget",
    "build_bundle",
    "check_bundle",
    "load_bundle",
    "model_hash_of_folder",
    "open_frozen_linears",
    "prepare_main",
    "resolve_soc",
]
