"""QNN HTP backend (onnxruntime-qnn plugin EP): static token buckets, FP16 or QDQ graphs, EP-context disk cache.

Forms (docs/qnn_htp.md §1; measured choice in bench/kernels.py, recorded in ``FORM_CHOICE``):
- ``dynamic`` (default for fp16): the FP16 weight is a graph input in the tall layout; one host copy serves both
  directions and all buckets, QNN graphs hold no weight. Same simulator run time as static.
- ``static``: weights as initializers, one graph per direction and bucket, so QNN holds one copy per graph.
  Quantized precisions (w8a16, w8a8, w4a16) always use it: only full-QDQ graphs store int weights (docs/qnn_htp.md §2).
Every session sets ``session.disable_cpu_ep_fallback=1``; every graph passes ``audit_graph`` before it is built.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import structlog
import torch
from torch import Tensor

from lorad.kernels._qnn_graphs import audit_graph, fp16_dynamic_weight, fp16_static_weight, qdq_static
from lorad.kernels._quant import ACT_BITS, WEIGHT_BITS, check_precision, quantize_weight
from lorad.kernels.capabilities import CAPABILITIES
from lorad.kernels.detect import _soc, qnn_ep_devices

log = structlog.get_logger(__name__)

SUPPORTED = CAPABILITIES["qnn-htp"].precisions
FORMS = ("dynamic", "static")
# Chosen by measurement (bench/kernels.py --htp, SmolLM2 shapes at T=256 on the x86 simulator): run times are equal
# within noise (e.g. gate 1536x576 fwd 354 vs 272 ms, up 550 vs 779 ms, down 276 vs 256 ms, dynamic vs static), but
# dynamic holds one fp16 host copy for both directions and all buckets while static holds one copy per graph
# (2 directions x buckets), and dynamic graphs are weight-free, so one session serves every layer of a shape.
FORM_CHOICE = "dynamic"
_CACHE_VERSION = "1"


def htp_unavailable_reason() -> str:
    """Empty string if the QNN HTP EP loads here, else why not."""
    try:
        qnn_ep_devices()
        import onnxruntime_qnn as oq

        if not Path(oq.get_qnn_htp_path()).exists():
            return f"HTP backend library missing: {oq.get_qnn_htp_path()}"
    except Exception as exc:  # import error, registration failure, no device
        return f"{type(exc).__name__}: {exc}"
    return ""


def _session_options(ctx_out: Path | None) -> ort.SessionOptions:
    import onnxruntime_qnn as oq

    soc, arch = _soc()
    so = ort.SessionOptions()
    so.add_provider_for_devices(
        qnn_ep_devices(), {"backend_path": oq.get_qnn_htp_path(), "soc_model": soc, "htp_arch": arch}
    )
    # Any node the HTP cannot take must fail the build instead of silently running on the CPU EP.
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.log_severity_level = 3
    if ctx_out is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(ctx_out))
        so.add_session_config_entry("ep.context_embed_mode", "1")
    return so


_POOL: dict[str, ort.InferenceSession] = {}  # weight-free graphs -> one shared session per process
_POOL_LOCK = threading.Lock()


def pooled_session(model: bytes, cache_path: Path | None) -> tuple[ort.InferenceSession, str]:
    """One session per distinct weight-free graph, shared by every layer of that shape (each QNN session costs
    ~23 MB RSS, docs/qnn_htp.md §6, so 200+ per-layer sessions would cost GBs)."""
    # The SoC options and the cache file are part of the key: a session compiled for another target, or one whose
    # EP-context file lives in another cache directory, is not reused.
    key = "|".join((hashlib.sha256(model).hexdigest(), *_soc(), str(cache_path)))
    with _POOL_LOCK:
        sess = _POOL.get(key)
        if sess is not None:
            return sess, "shared"
        sess, how = build_session(lambda: model, cache_path)
        _POOL[key] = sess
        return sess, how


def clear_session_pool() -> None:
    """Drop the shared sessions (frees their QNN memory once no frozen linear references them)."""
    with _POOL_LOCK:
        _POOL.clear()


def build_session(make_model: Any, cache_path: Path | None) -> tuple[ort.InferenceSession, str]:
    """Load ``cache_path`` if present (ms), else build from ``make_model()`` and write the EP-context cache.

    Returns:
        (session, "cache" | "built").
    """
    if cache_path is not None and cache_path.exists():
        try:
            return ort.InferenceSession(str(cache_path), sess_options=_session_options(None)), "cache"
        except Exception as exc:  # a corrupt or foreign cache file: rebuild it
            log.warning("qnn_cache_load_failed", path=str(cache_path), error=str(exc))
            cache_path.unlink(missing_ok=True)
    model = make_model()
    problems = audit_graph(model)
    if problems:
        raise RuntimeError(f"refusing to build a QNN graph with known HTP hazards: {problems}")
    tmp = None
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(f".{cache_path.stem}.{os.getpid()}.tmp.onnx")
    sess = ort.InferenceSession(model, sess_options=_session_options(tmp))
    if tmp is not None and cache_path is not None and tmp.exists():
        tmp.replace(cache_path)  # atomic: a half-written cache is never loaded
    return sess, "built"


def _rademacher_bound(b_int: np.ndarray, b_scale: np.ndarray, rows: int = 64) -> float:
    """Output range for 8-bit outputs: max |±1-vector · B| over ``rows`` random sign vectors.

    The guaranteed L1 bound wastes ~log2(√K) of the 8 bits; rescaled activations (row absmax 1) have most entries
    well below 1, so random ±1 rows over-estimate typical outputs. Outliers beyond it clip (the planner's measured
    error shows it); 16-bit outputs keep the guaranteed bound.
    """
    g = np.random.default_rng(0)
    signs = g.choice(np.array([-1.0, 1.0], np.float32), size=(rows, b_int.shape[0]))
    return float(np.abs(signs @ (b_int.astype(np.float32) * b_scale[None, :])).max())


class QnnFrozenLinear:
    """Frozen linear on QNN HTP. Inputs are padded to the smallest fitting bucket (chunks of the largest)."""

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        precision: str,
        precision_bwd: str,
        name: str,
        cache_dir: Path | None,
        model_hash: str,
        buckets: tuple[int, ...],
        form: str | None = None,
    ) -> None:
        check_precision("qnn-htp", precision)
        check_precision("qnn-htp", precision_bwd)
        reason = htp_unavailable_reason()
        if reason:
            raise RuntimeError(f"qnn-htp backend unavailable: {reason}")
        if not buckets or min(buckets) <= 0:
            raise ValueError(f"buckets must be positive token counts, got {buckets}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.name, self.precision_fwd, self.precision_bwd = name, precision, precision_bwd
        self.form = form or FORM_CHOICE
        if self.form not in FORMS:
            raise ValueError(f"unknown QNN form {self.form!r}; choose one of {FORMS}")
        self.buckets = tuple(sorted(set(buckets)))
        self._cache_dir, self._model_hash = cache_dir, model_hash
        self._w: Tensor | None = weight.detach().float()
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._sessions: dict[tuple[str, int], ort.InferenceSession] = {}
        self.sources: dict[tuple[str, int], str] = {}  # (direction, bucket) -> "cache" | "built"
        self._held: dict[tuple[str, int], int] = {}  # bytes of weight inside each QNN graph (static forms)
        self._host: dict[str, np.ndarray] = {}
        self._qw: dict[int, tuple[Tensor, Tensor]] = {}
        self._prepare_host()
        for direction in ("fwd", "bwd"):
            if not self._dynamic(direction):
                for t in self.buckets:  # static graphs embed the weight: build them all now
                    self._session(direction, t)
        # Everything a later call needs is now inside the QNN graphs, the fp16 host copy or the channel scales:
        # drop the fp32 weight and the integer grids so no hidden copy stays alive.
        self._w = None
        self._chan_scale = {bits: s for bits, (_, s) in self._qw.items()}
        self._qw = {}

    # ---- setup -------------------------------------------------------------------------------------------
    def _precision(self, direction: str) -> str:
        return self.precision_fwd if direction == "fwd" else self.precision_bwd

    def _dynamic(self, direction: str) -> bool:
        return self._precision(direction) == "fp16" and self.form == "dynamic"

    def _quantized_any(self) -> bool:
        return any(self._precision(d) != "fp16" for d in ("fwd", "bwd"))

    def _prepare_host(self) -> None:
        assert self._w is not None
        if any(self._dynamic(d) for d in ("fwd", "bwd")):
            w16 = self._w.to(torch.float16)
            tall = w16 if self.out_features >= self.in_features else w16.t()
            self._host["W"] = np.ascontiguousarray(tall.numpy())
            if self._bias is not None:
                self._host["b"] = self._bias.to(torch.float16).numpy()
        if self._quantized_any():
            bits = {WEIGHT_BITS[p] for p in (self.precision_fwd, self.precision_bwd) if p != "fp16"}
            self._qw = {b: quantize_weight(self._w, b) for b in bits}

    def _key(self, direction: str, t: int) -> Path | None:
        if self._cache_dir is None:
            return None
        p = self._precision(direction)
        soc, arch = _soc()
        shape = f"{self.out_features}x{self.in_features}{'b' if self._bias is not None else ''}"
        if self._dynamic(direction):
            # Weight-free graph: one binary per shape, shared by every layer and model of that shape.
            ident, label = "", f"shape{shape}"
        elif self._model_hash:
            ident, label = self._model_hash, re.sub(r"[^A-Za-z0-9_.-]", "_", self.name or "linear")[:80]
        else:
            return None  # a static graph embeds the weights; without a model hash the key cannot name them
        form = "dynamic" if self._dynamic(direction) else "static"
        material = "|".join(
            map(str, (_CACHE_VERSION, ident, self.name if ident else "", p, direction, t, form, soc, arch,
                      shape, ort.__version__))
        )  # fmt: skip
        digest = hashlib.sha256(material.encode()).hexdigest()[:16]
        return self._cache_dir / f"{label}-{p}-{direction}-T{t}-{form}-soc{soc}-{digest}_ctx.onnx"

    def context_path(self, direction: str, bucket: int) -> Path | None:
        """The EP-context cache file of one (direction, bucket) graph (None when nothing is cached)."""
        return self._key(direction, bucket)

    def _model(self, direction: str, t: int) -> bytes:
        p = self._precision(direction)
        bias = None if self._bias is None else self._bias.numpy()
        if self._dynamic(direction):
            return fp16_dynamic_weight(self.out_features, self.in_features, t, bias is not None, direction)
        if p == "fp16":
            assert self._w is not None
            return fp16_static_weight(self._w.t().contiguous().numpy(), t, bias, direction)
        q, s = self._qw[WEIGHT_BITS[p]]
        a_bits = ACT_BITS[p]
        if direction == "fwd":
            b_int, b_scale = q.t().numpy(), s.numpy()  # B = Wqᵀ [in, out], per-out-channel scale along N
            bound = float((q.abs().float() * s[:, None]).sum(1).max())  # |x̂|≤1 -> |y_j| ≤ ‖W_j‖₁
            a_name = "x"
        else:
            # dy·diag(s)·Wq: s is folded into dy on the host, so B = Wq [out, in] with unit scales along N.
            b_int, b_scale = q.numpy(), np.ones(self.in_features, np.float32)
            bound = float(q.abs().float().sum(0).max())
            a_name = "dy"
        if a_bits == 8:
            bound = min(bound, _rademacher_bound(b_int, b_scale))
        return qdq_static(b_int, b_scale, t, WEIGHT_BITS[p], a_bits, bound, a_name)

    def _session(self, direction: str, t: int) -> ort.InferenceSession:
        sess = self._sessions.get((direction, t))
        if sess is None:
            if self._dynamic(direction):
                sess, how = pooled_session(self._model(direction, t), self._key(direction, t))
            else:
                sess, how = build_session(lambda: self._model(direction, t), self._key(direction, t))
            self._sessions[(direction, t)] = sess
            self.sources[(direction, t)] = how
            if not self._dynamic(direction):
                p = self._precision(direction)
                per = {"fp16": 2.0, "w8a16": 1.0, "w8a8": 1.0, "w4a16": 0.5}[p]
                self._held[(direction, t)] = int(per * self.out_features * self.in_features)
            log.debug("qnn_session_ready", layer=self.name, direction=direction, bucket=t, source=how)
        return sess

    # ---- public ------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        # Host copies + weight bytes inside QNN static graphs (≈ .bin size per graph, docs/qnn_htp.md §1).
        host = sum(a.nbytes for a in self._host.values())
        small = sum(s.numel() * 4 for s in self._chan_scale.values())
        bias = 0 if self._bias is None else self._bias.numel() * 4
        return host + sum(self._held.values()) + bias + small

    def warmup(self) -> None:
        """Build (or load from cache) every bucket's sessions now instead of on first use."""
        for direction in ("fwd", "bwd"):
            for t in self.buckets:
                self._session(direction, t)

    def forward(self, x: Tensor) -> Tensor:
        return self._apply("fwd", x, self.out_features)

    def input_grad(self, dy: Tensor) -> Tensor:
        return self._apply("bwd", dy, self.in_features)

    def _apply(self, direction: str, a: Tensor, n_out: int) -> Tensor:
        a = a.detach().float()
        rows = a.shape[0]
        out = torch.empty(rows, n_out, dtype=torch.float32)
        big = self.buckets[-1]
        for start in range(0, rows, big):
            chunk = a[start : start + big]
            out[start : start + chunk.shape[0]] = self._run(direction, chunk)
        return out

    def _run(self, direction: str, a: Tensor) -> Tensor:
        rows = a.shape[0]
        t = next(b for b in self.buckets if b >= rows)
        p = self._precision(direction)
        in_name = "x" if direction == "fwd" else "dy"
        sess = self._session(direction, t)
        if p == "fp16":
            buf = np.zeros((t, a.shape[1]), np.float16)
            buf[:rows] = a.numpy()
            feeds: dict[str, Any] = {in_name: buf}
            if self._dynamic(direction):
                feeds["W"] = self._host["W"]
                if direction == "fwd" and "b" in self._host:
                    feeds["b"] = self._host["b"]
            y = sess.run(None, feeds)[0][:rows]
            return torch.from_numpy(y.astype(np.float32))
        if direction == "bwd":
            a = a * self._chan_scale[WEIGHT_BITS[p]]  # fold the per-output-channel scale into dy
        # Per-call, per-row rescale to [-1, 1]: the graph's static scales assume it; exact since the op is linear.
        r = a.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        buf = np.zeros((t, a.shape[1]), np.float32)
        buf[:rows] = (a / r).numpy()
        y = torch.from_numpy(sess.run(None, {in_name: buf})[0][:rows]) * r
        if direction == "fwd" and self._bias is not None:
            y += self._bias
        return y
