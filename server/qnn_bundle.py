"""The configured QNN context bundle: checked against the default model at startup, then used to build it on qnn-htp."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from lorad.server.modelhost import ModelEntry

if TYPE_CHECKING:
    import torch

    from lorad.server.engine.api import Bundle, CausalLM, LoadedModel, LoraConfig, ModelConfig

log = structlog.get_logger(__name__)


class StartupError(RuntimeError):
    """The daemon cannot start with this configuration; the message says what to change."""


@dataclass(frozen=True)
class PreparedBundle:
    """A verified bundle and the model folder it was checked against."""

    bundle: Bundle
    model_dir: Path
    source: Path | None  # the ModelEntry.source the bundle belongs to (None = the packaged default)


def open_bundle(path: str, entry: ModelEntry, cache_root: Path) -> PreparedBundle:
    """Loads ``path`` for ``entry``'s model on this device, keyed by ``model_hash_of_folder`` of its folder.

    Raises:
        StartupError: the bundle is for another model, SoC or runtime, is corrupt, or the model cannot be read.
    """
    from lorad.server.engine.api import BundleError, load_bundle, model_hash_of_folder, resolve

    root = Path(path).expanduser()
    try:
        folder = resolve(entry.source, cache_root).path  # a GGUF default is converted to an HF folder once
        model_hash = model_hash_of_folder(folder)
    except FileNotFoundError as exc:
        raise StartupError(f"training.qnn_bundle = {str(root)!r}: cannot read the default model: {exc}") from None
    try:
        bundle = load_bundle(root, model_hash=model_hash)
    except BundleError as exc:  # BundleMismatchError included
        raise StartupError(f"training.qnn_bundle = {str(root)!r} refused: {exc}") from None
    log.info("qnn_bundle_ready", bundle=str(root), model=entry.name, model_hash=model_hash[:12])
    return PreparedBundle(bundle, folder, entry.source)


def assemble(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    linears: Mapping[str, Any],
    lora: LoraConfig | None,
    embed_fp16: bool = False,
) -> CausalLM:
    """The CausalLM whose frozen projections are ``linears`` (layer name -> FrozenLinear), with LoRA on top.

    build_model lays the model out; the projection weights are given to it as meta tensors (no memory), and each
    layer's frozen placeholder is then swapped for the prepared one (LoRALinear resolves its queue per call, so a
    swapped layer runs on its own backend's queue).

    ``embed_fp16`` keeps the embedding table in fp16, as build_model does for a reduced-precision head (half the
    bytes; the lookup is upcast per call).

    Raises:
        ValueError: a projection of the model has no entry in ``linears``.
    """
    from lorad.server.engine.api import Linear, build_model

    names = set(linears)
    skeleton = {k: (v.to("meta") if k.rsplit(".", 1)[0] in names else v) for k, v in weights.items()}
    model = build_model(cfg, skeleton, backend="torch", precision="fp32", lora=lora)
    missing = []
    for m in model.modules():
        if isinstance(m, Linear):
            lin = linears.get(m.name)
            if lin is None:
                missing.append(m.name)
                continue
            m.frozen = lin
            m.lora.frozen = lin
    if missing:
        raise ValueError(f"no prepared linear for {len(missing)} layers: {missing[:5]}")
    if embed_fp16:
        import torch

        model.embed_tokens = model.embed_tokens.to(torch.float16)  # drops the placeholder head's fp32 table
    return model


def bundle_loader(pb: PreparedBundle) -> Callable[..., LoadedModel]:
    """A loader with ``load_model``'s signature that builds ``pb``'s model on qnn-htp from the bundle.

    Other models, and other backends a job asks for explicitly, load as usual.
    """
    from lorad.server.engine.api import LoadedModel, load_model, resolve

    def load(
        source: str | Path | None = None,
        *,
        cache_root: Path,
        backend: str = "torch",
        precision: Any = "fp32",
        lora: LoraConfig | None = None,
    ) -> LoadedModel:
        same = (source is None and pb.source is None) or (
            source is not None and pb.source is not None and Path(source).expanduser() == pb.source
        )
        if backend != "qnn-htp" or not same:
            return load_model(source, cache_root=cache_root, backend=backend, precision=precision, lora=lora)
        from lorad.server.engine.api import ChatTokenizer, open_frozen_linears, read_config, read_weights

        ck = resolve(source, cache_root)
        cfg = read_config(ck.path)
        linears = open_frozen_linears(pb.bundle, pb.model_dir)  # refuses any graph that would have to be built
        head_fwd, _ = pb.bundle.plan.for_layer("lm_head")
        model = assemble(cfg, read_weights(ck.path), linears, lora, embed_fp16=head_fwd != "fp32")
        log.info("model_built_from_bundle", layers=len(linears), plan="bundle", requested_precision=str(precision))
        return LoadedModel(model, ChatTokenizer.from_dir(ck.path), cfg, ck)

    return load
