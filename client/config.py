"""Where the client finds the daemon and its token: arguments, then environment, then client.toml, then defaults."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorad.client._atomic import atomic_write_text
from lorad.client.errors import ConfigurationError

ENV_TARGET = "LORAD_TARGET"
ENV_TOKEN = "LORAD_TOKEN"
ENV_OWNER_TOKEN = "LORAD_OWNER_TOKEN"
ENV_DATA_DIR = "LORAD_STORAGE_DATA_DIR"  # the daemon's own override of storage.data_dir
ENV_SOCKET = "LORAD_SERVER_SOCKET_PATH"  # the daemon's own override of server.socket_path
ENV_DAEMON_CONFIG = "LORAD_CONFIG"  # the daemon's TOML file
ENV_CONFIG = "LORAD_CLIENT_CONFIG"
OWNER_TOKEN_FILE = "owner.token"
SOCKET_NAME = "lorad.sock"
DEFAULT_TIMEOUT_SECONDS = 30.0


def config_file_path() -> Path:
    """The client config file: $LORAD_CLIENT_CONFIG, else $XDG_CONFIG_HOME/lorad/client.toml (~/.config default)."""
    if os.environ.get(ENV_CONFIG):
        return Path(os.environ[ENV_CONFIG]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "lorad" / "client.toml"


def _daemon_toml() -> dict[str, Any]:
    """The daemon's own config file ($LORAD_CONFIG), read for its data dir and socket; {} when absent."""
    path = os.environ.get(ENV_DAEMON_CONFIG)
    if not path:
        return {}
    try:
        return tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}  # the daemon reports a broken config itself; fall back to the defaults here


def default_data_dir() -> Path:
    """The daemon's data directory as lorad.server.config resolves it (mirrored here, without importing it).

    $LORAD_STORAGE_DATA_DIR, else `storage.data_dir` of $LORAD_CONFIG, else on Termux ($PREFIX contains
    com.termux) $HOME/.local/share/lorad, else $XDG_DATA_HOME/lorad (default ~/.local/share/lorad).
    """
    explicit = os.environ.get(ENV_DATA_DIR) or _daemon_toml().get("storage", {}).get("data_dir")
    if explicit:
        return Path(explicit).expanduser()
    home = Path(os.environ.get("HOME") or Path.home())
    if "com.termux" in os.environ.get("PREFIX", ""):
        return home / ".local" / "share" / "lorad"
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else home / ".local" / "share") / "lorad"


def default_socket_path(data_dir: Path | None = None) -> Path:
    """The daemon's Unix socket as lorad.server.config resolves it.

    $LORAD_SERVER_SOCKET_PATH, else `server.socket_path` of $LORAD_CONFIG, else <data_dir>/run/lorad.sock.
    An explicit data_dir always means <data_dir>/run/lorad.sock.
    """
    if data_dir is None:
        explicit = os.environ.get(ENV_SOCKET) or _daemon_toml().get("server", {}).get("socket_path")
        if explicit:
            return Path(explicit).expanduser()
    return (data_dir or default_data_dir()) / "run" / SOCKET_NAME


def normalize_target(target: str) -> str:
    """Turns a socket path or host:port into a gRPC target string.

    Args:
        target: "unix:/path", "unix:///path", a filesystem path, or "host:port".

    Returns:
        "unix:///abs/path" for sockets, "host:port" otherwise.
    """
    if target.startswith("unix:"):
        return target
    if target.startswith(("/", ".", "~")) or target.endswith(".sock"):
        return "unix://" + str(Path(target).expanduser().resolve())
    return target


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    """Reads client.toml (keys: target, token, data_dir, timeout_seconds); a missing file is an empty config.

    Raises:
        ConfigurationError: The file exists but is not valid TOML or has keys of the wrong type.
    """
    path = path or config_file_path()
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read the client config {path}: {exc}; fix or delete the file") from exc
    kinds: dict[str, tuple[type, ...]] = {
        "target": (str,),
        "token": (str,),
        "data_dir": (str,),
        "timeout_seconds": (int, float),
    }
    problems = [
        f"{key} = {data[key]!r}: must be a {' or '.join(k.__name__ for k in kind)}"
        for key, kind in kinds.items()
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool))
    ]
    if problems:
        raise ConfigurationError(f"invalid client config {path}: " + "; ".join(problems))
    return data


@dataclass(frozen=True)
class ClientSettings:
    """Resolved connection settings.

    Attributes:
        target: gRPC target, "unix:///abs/path.sock" or "host:port".
        token: Bearer token sent with every call; None when none was configured.
        timeout_seconds: Deadline of each unary call attempt, seconds.
        token_source: Where the token came from, for error messages ("argument", "LORAD_TOKEN", a file path).
    """

    target: str
    token: str | None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    token_source: str = ""


def resolve(
    target: str | None = None,
    token: str | None = None,
    *,
    timeout_seconds: float | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    config_path: Path | None = None,
) -> ClientSettings:
    """Resolves connection settings: explicit arguments, then environment, then client.toml, then defaults.

    Args:
        target: Socket path or host:port; default the socket of ``data_dir`` when given, else LORAD_TARGET,
            client.toml, or the daemon's default socket.
        token: App (or owner) token; default from LORAD_TOKEN, else client.toml's token when client.toml names
            no target or the same target.
        timeout_seconds: Per-call deadline; default from client.toml or 30 s.
        data_dir: The daemon's data directory: its socket outranks LORAD_TARGET and client.toml.
        config_path: Overrides the client.toml location.

    Returns:
        The settings.
    """
    cfg = load_config_file(config_path)
    cfg_path = str(config_path or config_file_path())
    # The address: --target, then --data-dir (that daemon's socket, so `--data-dir d2` never reaches another
    # daemon through a saved target), then LORAD_TARGET, client.toml's target, client.toml's data_dir, defaults.
    if target is None and data_dir is not None:
        target = str(default_socket_path(Path(data_dir)))
    if target is None:
        target = os.environ.get(ENV_TARGET) or cfg.get("target")
    if target is None:
        target = str(default_socket_path(Path(cfg["data_dir"]) if cfg.get("data_dir") else None))
    resolved = normalize_target(target)
    source = "argument"
    if token is None and os.environ.get(ENV_TOKEN):
        token, source = os.environ[ENV_TOKEN], ENV_TOKEN
    # A saved token belongs to the saved target: it is not sent to another daemon.
    saved_for = cfg.get("target")
    if token is None and cfg.get("token") and (not saved_for or normalize_target(saved_for) == resolved):
        token, source = cfg["token"], cfg_path
    if timeout_seconds is None:
        timeout_seconds = float(cfg.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
    return ClientSettings(resolved, token or None, timeout_seconds, source if token else "")


def owner_token(data_dir: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """The device owner's token and where it came from ("LORAD_OWNER_TOKEN" or the file's path).

    Raises:
        ConfigurationError: Neither is available; the message names both.
    """
    if os.environ.get(ENV_OWNER_TOKEN):
        return os.environ[ENV_OWNER_TOKEN].strip(), ENV_OWNER_TOKEN
    path = (Path(data_dir) if data_dir is not None else default_data_dir()) / OWNER_TOKEN_FILE
    try:
        return path.read_text(encoding="utf-8").strip(), str(path)
    except OSError as exc:
        raise ConfigurationError(
            f"no owner token: cannot read {path} ({exc.strerror}). The daemon creates it at first start; "
            f"run as the device owner, pass --data-dir, or set {ENV_OWNER_TOKEN}"
        ) from exc


def read_owner_token(data_dir: str | os.PathLike[str] | None = None) -> str:
    """The device owner's token: $LORAD_OWNER_TOKEN, else <data_dir>/owner.token (see owner_token)."""
    return owner_token(data_dir)[0]


def save_token(token: str, target: str | None = None, path: Path | None = None) -> Path:
    """Writes `token` (and optionally `target`) into client.toml, mode 0600, keeping other keys.

    Returns:
        The file written.
    """
    path = path or config_file_path()
    data = load_config_file(path)
    data["token"] = token
    if target is not None:
        data["target"] = target
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items()]
    # atomic_write's temp file is mode 0600 and the token file keeps it.
    header = "# lorad client settings (written by `lorad app register --save`)\n"
    atomic_write_text(path, header + "\n".join(lines) + "\n")
    return path


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'
