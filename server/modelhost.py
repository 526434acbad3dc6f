"""The models the daemon offers, by name, and one loaded base model per name shared by every Generate call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from lorad.server.backend import BackendDecision
from lorad.server.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from lorad.server.engine.api import LoadedModel

log = structlog.get_logger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"


def import_engine() -> None:
    """Imports the engine's training and generation modules once. The engine is imported lazily (lorad serve starts
    without torch), always through ``lorad.server.engine.api``, whose one import lock keeps two threads (a job
    starting while a Generate loads its base) from meeting a partially initialised module."""
    from lorad.server.engine.api import warm_up

    warm_up()


@dataclass(frozen=True)
class ModelFacts:
    """What status reports about a model: family, parameter count (stored weights) and content hash."""

    family: str
    parameters: int
    sha256: str


READING = "reading the model for the first time (a GGUF is converted into the cache once)"
UNREADABLE = "not readable"  # an app's whole detail; the owner's detail goes on with ": <the error>"
FACTS_RETRY_S = 60.0


@dataclass(frozen=True)
class _Unknown:
    """Why a model's facts are not known: being read (``failed_at`` None), or the read failed then (monotonic s)."""

    detail: str
    failed_at: float | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A model name and where it loads from (None = the bundled SmolLM2 GGUF)."""

    name: str
    source: Path | None
    is_default: bool


class ModelHost:
    """Resolves model names; loads each base once for inference (adapters are swapped per call, base stays)."""

    def __init__(
        self,
        default_model: str,
        model_dirs: tuple[str, ...],
        cache_root: Path,
        backend: BackendDecision,
        loader: Callable[..., LoadedModel] | None = None,
    ) -> None:
        """``backend`` is the daemon's decision; ``loader`` has ``lorad.server.engine.api.load_model``'s signature
        (default: that function)."""
        self.cache_root = cache_root
        self.backend = backend
        self.loader = loader
        entries: list[ModelEntry] = []
        if default_model:
            p = Path(default_model).expanduser()
            entries.append(ModelEntry(p.name.lower(), p, True))
        else:
            entries.append(ModelEntry(DEFAULT_NAME, None, True))
        for d in model_dirs:
            p = Path(d).expanduser()
            if p.name.lower() not in {e.name for e in entries}:
                entries.append(ModelEntry(p.name.lower(), p, False))
        self.entries = {e.name: e for e in entries}
        self.default = entries[0]
        self._loaded: dict[str, LoadedModel] = {}
        self._facts: dict[str, ModelFacts | _Unknown] = {}
        self._facts_lock = threading.Lock()
        self._lock = threading.Lock()  # one load at a time; generation itself is serialised by the caller

    def entry(self, name: str, field: str = "config.base_model") -> ModelEntry:
        """The entry for a name ("" = the default).

        Raises:
            InvalidArgument: unknown name (the known ones are listed).
        """
        if not name:
            return self.default
        e = self.entries.get(name.lower())
        if e is None:
            raise InvalidArgument(field, f"unknown model {name[:64]!r}; one of {', '.join(sorted(self.entries))}")
        return e

    def loaded(self, name: str) -> LoadedModel | None:
        """The loaded base for ``name`` if it is already in memory (for status), else None."""
        return self._loaded.get(self.entry(name).name)

    def facts(self, name: str) -> ModelFacts | str:
        """Family, parameter count and sha256 of a model without loading it, or why they are not known (yet).

        Never waits: the first call per model starts reading it on a background thread (a GGUF is converted into the
        cache once, 16 s on a 2-core AVX2-only EPYC plus torch's import, past the 15 s attempt deadline of a
        client waiting for the daemon) and says so until it is done; later calls are a dict lookup. A model already
        in the cache is read from its manifest and safetensors headers, without torch, so an idle daemon stays
        small. A model that cannot be read gets the error, and a call FACTS_RETRY_S after the failure tries again (a
        client polling status every second must not keep re-reading a broken model while a job trains).
        """
        e = self.entry(name)
        with self._facts_lock:
            known = self._facts.get(e.name)
            if isinstance(known, ModelFacts):
                return known
            if known is None or (known.failed_at is not None and time.monotonic() - known.failed_at >= FACTS_RETRY_S):
                self._facts[e.name] = _Unknown(READING)
                threading.Thread(target=self._read_facts, args=(e,), name=f"model-facts-{e.name}", daemon=True).start()
            return known.detail if known is not None else READING

    def _read_facts(self, e: ModelEntry) -> None:
        from lorad.server.engine.api import cached_checkpoint, read_config, read_weights  # none of them needs torch

        got: ModelFacts | _Unknown
        try:
            ck = cached_checkpoint(e.source, self.cache_root)
            if ck is None:  # first use of this source: convert or hash it once (the engine, and so torch)
                from lorad.server.engine.api import resolve

                ck = resolve(e.source, self.cache_root)
            got = ModelFacts(read_config(ck.path).arch, read_weights(ck.path).parameter_count(), ck.model_hash)
        except Exception as exc:  # a missing or broken model must not break status, nor stay "reading" for ever
            log.warning("model_facts_unavailable", model=e.name, error=type(exc).__name__)
            got = _Unknown(f"{UNREADABLE}: {type(exc).__name__}: {str(exc)[:200]}", time.monotonic())
        with self._facts_lock:
            self._facts[e.name] = got

    def base(self, name: str) -> LoadedModel:
        """The base model for inference (a ``LoadedModel`` without LoRA), loading it on first use."""
        e = self.entry(name)
        with self._lock:
            if e.name not in self._loaded:
                import_engine()
                from lorad.kernels.capabilities import capability
                from lorad.server.engine.api import load_model

                info = self.backend.info
                try:
                    self._loaded[e.name] = (self.loader or load_model)(
                        e.source,
                        cache_root=self.cache_root,
                        backend=info.name,
                        precision=capability(info.name).generation(),
                        lora=None,
                    )
                except OSError as exc:  # a missing or unreadable model folder; its path stays in the log
                    log.warning("inference_model_unavailable", model=e.name, error_type=type(exc).__name__)
                    raise FailedPrecondition(
                        f"model {e.name!r} is not available on this device (its files are missing or unreadable); "
                        "ask the device owner to reinstall it or pick another base_model"
                    ) from None
                log.info("inference_model_loaded", model=e.name, backend=info.name)
            return self._loaded[e.name]
