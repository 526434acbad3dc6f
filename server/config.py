"""Daemon configuration: frozen dataclasses from one TOML file plus LORAD_<SECTION>_<KEY> environment overrides."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBES = ("auto", "termux", "sysfs", "file")
PROFILES = ("auto", "phone", "laptop", "server")
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
BACKENDS = ("auto", "torch", "ort-cpu", "qnn-htp")
ALLOCATORS = ("auto", "tcmalloc", "system")  # server/allocator.py
MIB = 1024 * 1024


class ConfigError(ValueError):
    """The configuration has problems; ``errors`` lists every one (key, bad value, allowed values)."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid lorad configuration:\n  - " + "\n  - ".join(errors))
        self.errors = errors


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where lorad keeps its state when ``storage.data_dir`` is not set.

    Termux (``$PREFIX`` contains ``com.termux``) has no XDG conventions; its apps use ``$HOME/.local/share``.
    Elsewhere ``$XDG_DATA_HOME/lorad`` (default ``~/.local/share/lorad``).
    """
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    if "com.termux" in env.get("PREFIX", ""):
        return home / ".local" / "share" / "lorad"
    xdg = env.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else home / ".local" / "share") / "lorad"


@dataclass(frozen=True)
class ServerSection:
    """Listening sockets and gRPC limits."""

    socket_path: str = field(default="", metadata=_help("Unix socket; empty means <data_dir>/run/lorad.sock."))
    tcp_address: str = field(
        default="", metadata=_help("Optional loopback TCP listener, e.g. '127.0.0.1:50051' (port 0 = any); '' = off.")
    )
    max_message_bytes: int = field(
        default=17 * MIB, metadata=_help("Largest gRPC message in either direction, bytes (AppendSamples is 16 MiB).")
    )
    shutdown_grace_seconds: float = field(default=5.0, metadata=_help("In-flight RPCs get this long on shutdown, s."))
    checkpoint_timeout_seconds: float = field(
        default=60.0, metadata=_help("On shutdown, how long to wait for the running job's checkpoint, s.")
    )


@dataclass(frozen=True)
class StorageSection:
    """Where state lives."""

    data_dir: str = field(default="", metadata=_help("State directory; empty means the platform default."))
    keep_checkpoints: int = field(default=2, metadata=_help("Checkpoints kept per job (>= 1)."))
    export_cache_max_mb: int = field(
        default=1024,
        metadata=_help(
            "Cached download files (all apps) are kept below this many MiB, least recently served go "
            "first; 0 = no cap. A merged SmolLM2-135M export is ~270 MiB."
        ),
    )


@dataclass(frozen=True)
class QuotaSection:
    """Default per-app limits (RegisterApp may set lower or higher ones)."""

    max_samples: int = field(default=100_000, metadata=_help("Stored samples per app."))
    max_sample_bytes: int = field(default=256 * MIB, metadata=_help("Stored sample bytes per app."))
    max_adapters: int = field(default=20, metadata=_help("Adapters kept per app."))
    max_active_jobs: int = field(default=4, metadata=_help("Jobs per app that are not final."))


@dataclass(frozen=True)
class ConditionsSection:
    """Default device requirements for training and the probes that read them."""

    require_charging: bool = field(default=True, metadata=_help("Train only on a charger."))
    min_battery_percent: int = field(default=50, metadata=_help("When not charging, train only at >= this %."))
    max_temperature_celsius: float = field(default=40.0, metadata=_help("Train only at <= this temperature, °C."))
    require_idle: bool = field(default=False, metadata=_help("Train only while idle (where the probe can tell)."))
    probe: str = field(default="auto", metadata=_help(f"Reading source: one of {PROBES}."))
    probe_file: str = field(default="", metadata=_help("JSON file read by probe = 'file' (tests, demo)."))
    poll_seconds: float = field(default=30.0, metadata=_help("Seconds between condition checks."))
    termux_timeout_seconds: float = field(default=5.0, metadata=_help("termux-battery-status can hang; timeout, s."))


@dataclass(frozen=True)
class DeviceSection:
    """What kind of device this is, and hooks into it: a wake lock held only while a job trains."""

    profile: str = field(
        default="auto",
        metadata=_help(
            f"One of {PROFILES}: phone gates training on charger, battery and temperature (an unreadable sensor "
            "means wait); laptop on charger and battery; server (mains power) on none; auto = phone with "
            "termux-battery-status or a file probe, laptop with a battery in /sys/class/power_supply, else server."
        ),
    )

    wake_lock_acquire: str = field(
        default="", metadata=_help("Shell command run when a job starts training (e.g. take a wake lock); '' = none.")
    )
    wake_lock_release: str = field(
        default="", metadata=_help("Shell command run when training stops and at shutdown; '' = none.")
    )
    wake_lock_timeout_seconds: float = field(
        default=10.0, metadata=_help("Each hook command is killed after this many seconds, s.")
    )


@dataclass(frozen=True)
class SchedulerSection:
    """Nightly windows."""

    misfire_grace_hours: float = field(
        default=12.0, metadata=_help("A window missed while the phone slept still fires this many hours late.")
    )
    timezone: str = field(default="", metadata=_help("IANA zone for windows without one; empty = device local."))


@dataclass(frozen=True)
class TrainingSection:
    """Models and compute."""

    backend: str = field(default="auto", metadata=_help(f"Frozen-matmul backend: one of {BACKENDS}."))
    default_model: str = field(
        default="", metadata=_help("Default base model: empty = packaged SmolLM2-135M-Instruct, or an HF folder path.")
    )
    model_dirs: tuple[str, ...] = field(default=(), metadata=_help("Extra HF model folders, named by folder name."))
    torch_threads: int = field(default=0, metadata=_help("torch intra-op threads for training; 0 = torch default."))
    allocator: str = field(
        default="auto",
        metadata=_help(f"The daemon's malloc: one of {ALLOCATORS}; auto = tcmalloc where glibc Linux has it."),
    )
    qnn_bundle: str = field(
        default="",
        metadata=_help("A `lorad prepare` bundle for the default model: train on qnn-htp from it; '' = none."),
    )


@dataclass(frozen=True)
class LoggingSection:
    """Structured logs on stderr."""

    level: str = field(default="info", metadata=_help(f"One of {LOG_LEVELS}."))
    format: str = field(default="auto", metadata=_help(f"One of {LOG_FORMATS}; auto = JSON unless stderr is a TTY."))


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    server: ServerSection = field(default_factory=ServerSection)
    storage: StorageSection = field(default_factory=StorageSection)
    quotas: QuotaSection = field(default_factory=QuotaSection)
    conditions: ConditionsSection = field(default_factory=ConditionsSection)
    device: DeviceSection = field(default_factory=DeviceSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    @property
    def data_dir(self) -> Path:
        """The resolved state directory."""
        return Path(self.storage.data_dir).expanduser() if self.storage.data_dir else default_data_dir()

    @property
    def socket_path(self) -> Path:
        """The resolved Unix socket path."""
        if self.server.socket_path:
            return Path(self.server.socket_path).expanduser()
        return self.data_dir / "run" / "lorad.sock"


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _coerce(raw: Any, typ: Any, key: str, from_env: bool, errors: list[str]) -> Any:
    """Converts a TOML or environment value to the field's type; appends a message and returns None on failure."""
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if from_env and isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "0", "false", "no"):
            return raw.lower() in ("1", "true", "yes")
        errors.append(f"{key}={raw!r}: must be a boolean (true or false)")
    elif typ is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if from_env and isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
        errors.append(f"{key}={raw!r}: must be an integer")
    elif typ is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if from_env and isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
        errors.append(f"{key}={raw!r}: must be a number")
    elif typ is str:
        if isinstance(raw, str):
            return raw
        errors.append(f"{key}={raw!r}: must be a string")
    elif origin is tuple or isinstance(typ, types.GenericAlias):
        if from_env and isinstance(raw, str):
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if isinstance(raw, list) and all(isinstance(p, str) for p in raw):
            return tuple(raw)
        errors.append(f"{key}={raw!r}: must be a list of strings")
    return None


def _validate(cfg: Config) -> list[str]:
    e: list[str] = []

    def check(ok: bool, msg: str) -> None:
        if not ok:
            e.append(msg)

    s, q, c = cfg.server, cfg.quotas, cfg.conditions
    check(s.max_message_bytes >= MIB, f"server.max_message_bytes={s.max_message_bytes}: must be >= {MIB} (1 MiB)")
    check(s.shutdown_grace_seconds >= 0, f"server.shutdown_grace_seconds={s.shutdown_grace_seconds}: must be >= 0")
    check(
        s.checkpoint_timeout_seconds > 0,
        f"server.checkpoint_timeout_seconds={s.checkpoint_timeout_seconds}: must be >0",
    )
    if s.tcp_address:
        host, _, port = s.tcp_address.rpartition(":")
        check(
            host in ("127.0.0.1", "localhost", "[::1]") and port.isdigit() and int(port) <= 65535,
            f"server.tcp_address={s.tcp_address!r}: must be loopback 'host:port' with host one of "
            "127.0.0.1, localhost, [::1] and port 0..65535",
        )
    check(cfg.storage.keep_checkpoints >= 1, f"storage.keep_checkpoints={cfg.storage.keep_checkpoints}: must be >= 1")
    check(
        cfg.storage.export_cache_max_mb >= 0,
        f"storage.export_cache_max_mb={cfg.storage.export_cache_max_mb}: must be >= 0 (0 = no cap)",
    )
    for name in ("max_samples", "max_sample_bytes", "max_adapters", "max_active_jobs"):
        v = getattr(q, name)
        check(v >= 1, f"quotas.{name}={v}: must be >= 1")
    check(0 <= c.min_battery_percent <= 100, f"conditions.min_battery_percent={c.min_battery_percent}: must be 0..100")
    check(
        20 <= c.max_temperature_celsius <= 80,
        f"conditions.max_temperature_celsius={c.max_temperature_celsius}: must be 20..80",
    )
    check(c.probe in PROBES, f"conditions.probe={c.probe!r}: must be one of {', '.join(PROBES)}")
    check(c.probe != "file" or bool(c.probe_file), "conditions.probe_file='': required when conditions.probe = 'file'")
    check(c.poll_seconds > 0, f"conditions.poll_seconds={c.poll_seconds}: must be > 0")
    check(c.termux_timeout_seconds > 0, f"conditions.termux_timeout_seconds={c.termux_timeout_seconds}: must be > 0")
    prof = cfg.device.profile
    check(prof in PROFILES, f"device.profile={prof!r}: must be one of {', '.join(PROFILES)}")
    wl = cfg.device.wake_lock_timeout_seconds
    check(0 < wl <= 120, f"device.wake_lock_timeout_seconds={wl}: must be > 0 and <= 120")
    bundle = cfg.training.qnn_bundle
    check(
        not bundle or cfg.training.backend in ("auto", "qnn-htp"),
        f"training.qnn_bundle is set but training.backend={cfg.training.backend!r}: a bundle runs on 'qnn-htp' "
        "(or 'auto')",
    )
    grace = cfg.scheduler.misfire_grace_hours
    check(grace >= 0, f"scheduler.misfire_grace_hours={grace}: must be >= 0")
    backend = cfg.training.backend
    check(backend in BACKENDS, f"training.backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    check(cfg.training.torch_threads >= 0, f"training.torch_threads={cfg.training.torch_threads}: must be >= 0")
    alloc = cfg.training.allocator
    check(alloc in ALLOCATORS, f"training.allocator={alloc!r}: must be one of {', '.join(ALLOCATORS)}")
    level = cfg.logging.level
    check(level in LOG_LEVELS, f"logging.level={level!r}: must be one of {', '.join(LOG_LEVELS)}")
    check(
        cfg.logging.format in LOG_FORMATS,
        f"logging.format={cfg.logging.format!r}: must be one of {', '.join(LOG_FORMATS)}",
    )
    return e


def build_config(values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Builds and validates a Config from parsed TOML ``values`` and environment overrides.

    Args:
        values: ``{section: {key: value}}`` as read from TOML.
        env: environment; ``LORAD_<SECTION>_<KEY>`` overrides the file (default: ``os.environ``).

    Returns:
        The validated Config.

    Raises:
        ConfigError: every unknown key, mistyped value and out-of-range value, all at once.
    """
    env = os.environ if env is None else env
    errors: list[str] = []
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for name in sorted(set(values) - set(sections)):
        errors.append(f"[{name}]: unknown section; known sections: {', '.join(sections)}")
    built: dict[str, Any] = {}
    for sec_name in sections:
        sec_cls = _field_type(Config, sec_name)
        raw = values.get(sec_name, {})
        if not isinstance(raw, dict):
            errors.append(f"[{sec_name}]: must be a table")
            raw = {}
        keys = {f.name for f in dataclasses.fields(sec_cls)}
        for k in sorted(set(raw) - keys):
            errors.append(f"{sec_name}.{k}: unknown key; known keys: {', '.join(sorted(keys))}")
        kwargs: dict[str, Any] = {}
        for k in keys:
            typ = _field_type(sec_cls, k)
            env_key = f"LORAD_{sec_name.upper()}_{k.upper()}"
            if env_key in env:
                v = _coerce(env[env_key], typ, f"{env_key} ({sec_name}.{k})", True, errors)
            elif k in raw:
                v = _coerce(raw[k], typ, f"{sec_name}.{k}", False, errors)
            else:
                continue
            if v is not None:
                kwargs[k] = v
        built[sec_name] = sec_cls(**kwargs)
    cfg = Config(**built)
    errors.extend(_validate(cfg))
    if errors:
        raise ConfigError(errors)
    return cfg


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Loads the TOML file (``path``, else ``$LORAD_CONFIG``, else none) and applies environment overrides.

    Raises:
        ConfigError: the file cannot be read or parsed, or any value is invalid.
    """
    env = os.environ if env is None else env
    path = path or env.get("LORAD_CONFIG") or None
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError([f"config file {str(path)!r}: {exc}"]) from None
    return build_config(values, env)


def serve_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Config:
    """The configuration ``lorad serve argv`` runs with: its flags override the file's and the environment's values.

    Raises:
        ConfigError: the file cannot be read or parsed, or any value is invalid.
        SystemExit: bad flags (argparse prints the usage), or ``--help``.
    """
    p = argparse.ArgumentParser(prog="lorad serve", description="Run the lorad daemon.")
    p.add_argument("--config", help="TOML config file (default $LORAD_CONFIG)")
    p.add_argument("--data-dir", help="override storage.data_dir")
    p.add_argument("--socket", help="override server.socket_path")
    p.add_argument("--tcp", help="override server.tcp_address, e.g. 127.0.0.1:50051")
    args = p.parse_args(list(argv))
    merged = dict(os.environ if env is None else env)
    for key, val in (
        ("LORAD_STORAGE_DATA_DIR", args.data_dir),
        ("LORAD_SERVER_SOCKET_PATH", args.socket),
        ("LORAD_SERVER_TCP_ADDRESS", args.tcp),
    ):
        if val:
            merged[key] = val
    return load_config(args.config, merged)
