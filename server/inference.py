"""Generate: base + one of the app's adapters, streamed token by token from a worker thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from lorad.server.errors import FailedPrecondition, InvalidArgument
from lorad.server.modelhost import ModelHost
from lorad.server.records import AdapterRec, Message

if TYPE_CHECKING:
    from lorad.server.engine.api import AdapterWeights, LoadedModel

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GenRequest:
    """A validated Generate request."""

    text: str | None
    messages: tuple[Message, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    base_model: str
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class Piece:
    """Some new text; ``finish`` ("stop", "length", "context") on the last piece."""

    text: str
    token_count: int
    prompt_tokens: int = 0
    finish: str = ""


# The API's default repetition penalty (GenerateRequest.repetition_penalty = 0). 1.1 breaks a one-word loop of an
# over-fitted adapter within a few tokens; 1.2 already made SmolLM2-135M's plain answers drift (Dec 2026, by hand).
DEFAULT_REPETITION_PENALTY = 1.1


def check_repetition_penalty(penalty: float) -> float:
    """Validates GenerateRequest.repetition_penalty; returns it with the default filled in (0 → 1.1)."""
    if penalty == 0:
        return DEFAULT_REPETITION_PENALTY
    if not 1 <= penalty <= 2:
        raise InvalidArgument("repetition_penalty", f"{penalty} out of range; 1 to 2 (1 = off, 0 = default 1.1)")
    return penalty


def check_generate(max_tokens: int, temperature: float, top_p: float, stop: list[str]) -> tuple[int, float, float]:
    """Validates the sampling fields; returns (max_tokens, temperature, top_p) with defaults filled in."""
    n = max_tokens or 128
    if n > 2048:
        raise InvalidArgument("max_tokens", f"{n} > 2,048")
    if not 0 <= temperature <= 2:
        raise InvalidArgument("temperature", f"{temperature} out of range; 0 to 2 (0 = greedy)")
    if not 0 <= top_p <= 1:
        raise InvalidArgument("top_p", f"{top_p} out of range; 0 to 1 (0 = off)")
    if len(stop) > 8:
        raise InvalidArgument("stop", f"{len(stop)} stop strings > 8")
    for i, s in enumerate(stop):
        if not s or len(s.encode()) > 64:
            raise InvalidArgument(f"stop[{i}]", "must be 1 to 64 bytes")
    return n, temperature, top_p or 1.0


class Generator:
    """Runs generation for the InferenceService; one generation at a time (they share the loaded base)."""

    def __init__(self, models: ModelHost) -> None:
        self.models = models
        self._lock = threading.Lock()
        self._adapters: dict[str, tuple[str, AdapterWeights]] = {}

    def drop_app(self, app_id: str) -> None:
        """Forgets the app's adapter weights held in memory (ForgetApp)."""
        with self._lock:
            for k in [k for k, (owner, _) in self._adapters.items() if owner == app_id]:
                del self._adapters[k]

    def drop(self, adapter_ids: Collection[str]) -> None:
        """Forgets the weights of deleted adapters held in memory."""
        with self._lock:
            for k in adapter_ids:
                self._adapters.pop(k, None)

    def _adapter_weights(self, rec: AdapterRec, loaded: LoadedModel) -> AdapterWeights:
        from safetensors import SafetensorError

        from lorad.server.engine.api import load_adapter

        if rec.adapter_id not in self._adapters:
            try:
                ad = load_adapter(Path(rec.path))
            except (SafetensorError, ValueError, KeyError) as exc:  # torn or tampered files on disk
                raise FailedPrecondition(
                    f"adapter {rec.adapter_id} is corrupt on disk ({type(exc).__name__}); delete it and train again"
                ) from None
            try:
                ad.check_base(loaded.model_hash, loaded.tokenizer_hash)
            except ValueError as exc:  # AdapterBaseMismatchError: another base or tokenizer
                raise FailedPrecondition(str(exc)) from None
            self._adapters[rec.adapter_id] = (rec.app_id, ad.weights())
        return self._adapters[rec.adapter_id][1]

    def stream(
        self, req: GenRequest, rec: AdapterRec | None, cancelled: Callable[[], bool], extra: Sequence[AdapterRec] = ()
    ) -> Iterator[Piece]:
        """Yields text pieces (runs on a worker thread; stops early when ``cancelled()``).

        ``extra`` adapters apply together with ``rec``: their updates add (``compose``).
        """
        from lorad.server.modelhost import import_engine

        import_engine()
        from lorad.server.engine.api import SamplingConfig, generate

        for i, other in enumerate(extra):
            if rec is None or other.base_model != rec.base_model:
                raise InvalidArgument(f"extra_adapter_ids[{i}]", "needs adapter_id set and the same base model as it")
        base = req.base_model or (rec.base_model if rec else "")
        if rec is not None and req.base_model and self.models.entry(req.base_model).name != rec.base_model:
            raise InvalidArgument("base_model", f"adapter {rec.adapter_id} was trained on {rec.base_model!r}")
        loaded = self.models.base(base)
        tok = loaded.tokenizer
        if req.text is not None:
            ids = tok.encode(req.text)
        else:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages or ()]
            ids = tok.render_chat(msgs, add_generation_prompt=True)[0]
        room = loaded.config.max_position - len(ids)
        if room <= 0:
            raise InvalidArgument(
                "prompt", f"{len(ids)} prompt tokens fill the model's context ({loaded.config.max_position})"
            )
        n = min(req.max_tokens, room)
        cfg = SamplingConfig(
            max_new_tokens=n,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed if req.temperature > 0 else None,
            repetition_penalty=req.repetition_penalty,
        )
        hold = max((len(s) for s in req.stop), default=1) - 1  # chars held back so no stop string leaks
        with self._lock:
            adapter = self._adapter_weights(rec, loaded) if rec is not None else None
            if extra:
                adapter = compose([adapter, *(self._adapter_weights(r, loaded) for r in extra)])
            text, sent, count, first = "", 0, 0, True
            for t in generate(loaded.model, tok, ids, cfg, adapter=adapter):
                if t.finish_reason != "stop":
                    count += 1
                text += t.text
                cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
                if cut >= 0:
                    yield Piece(text[sent:cut], count, len(ids) if first else 0, "stop")
                    return
                finish = t.finish_reason or ""
                if finish == "length" and n < req.max_tokens:
                    finish = "context"
                end = len(text) if finish else max(sent, len(text) - hold)
                if end > sent or finish or first:
                    yield Piece(text[sent:end], count, len(ids) if first else 0, finish)
                    sent, first = end, False
                if finish or cancelled():
                    return


def compose(weights: Sequence[Any]) -> Any:
    """One AdapterWeights whose update is the sum of the given ones' (e.g. federated global + personal).

    Per module, A factors stack along the rank and B factors (each scaled by its own alpha/r) sit side by side, so
    B_cat·A_cat = Σ sᵢ·Bᵢ·Aᵢ exactly; the result's scale is 1. A module only some adapters target gets only theirs.
    """
    import torch

    from lorad.server.engine.api import AdapterWeights

    mods: dict[str, tuple[list[Any], list[Any]]] = {}
    for w in weights:
        for m, (a, b) in w.tensors.items():
            parts = mods.setdefault(m, ([], []))
            parts[0].append(a)
            parts[1].append(b * w.scale)
    return AdapterWeights({m: (torch.cat(a_s, 0), torch.cat(b_s, 1)) for m, (a_s, b_s) in mods.items()}, 1.0)


class GenerationQueue:
    """Admission for Generate: its own one-thread executor, one generation per app at a time, a bounded queue.

    Generation holds the shared base model for seconds; on the default executor it starved every other RPC (they
    all run their store calls there). Here it never touches that pool, and one app's burst waits behind itself:
    each app has at most ``per_app`` generations on the executor, the rest wait (up to ``max_waiting_per_app``).
    """

    def __init__(self, per_app: int = 1, max_waiting_per_app: int = 8, max_waiting: int = 32) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorad-generate")
        self.per_app, self.max_waiting_per_app, self.max_waiting = per_app, max_waiting_per_app, max_waiting
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._pending: dict[str, int] = {}

    def admit(self, app_id: str) -> Any:
        """An async context manager holding one of the app's generation slots.

        Raises:
            ResourceExhausted: the app's or the device's queue is full (the message names the limit).
        """
        import asyncio
        import contextlib

        from lorad.server.errors import ResourceExhausted

        mine, total = self._pending.get(app_id, 0), sum(self._pending.values())
        if mine >= self.max_waiting_per_app:
            raise ResourceExhausted(
                f"this app already has {mine} Generate calls in flight (limit "
                f"{self.max_waiting_per_app}); wait for one to finish"
            )
        if total >= self.max_waiting:
            raise ResourceExhausted(
                f"{total} Generate calls are queued on this device (limit {self.max_waiting}); retry in a few seconds"
            )
        slot = self._slots.setdefault(app_id, asyncio.Semaphore(self.per_app))

        @contextlib.asynccontextmanager
        async def held() -> Any:
            self._pending[app_id] = self._pending.get(app_id, 0) + 1
            try:
                async with slot:
                    yield
            finally:
                self._pending[app_id] -= 1
                if not self._pending[app_id]:
                    del self._pending[app_id]
                    self._slots.pop(app_id, None)

        return held()

    def close(self) -> None:
        """Stops taking work; queued generations are dropped, a running one ends at its next token."""
        self.pool.shutdown(wait=False, cancel_futures=True)
