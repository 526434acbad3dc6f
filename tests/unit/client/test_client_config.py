"""Connection settings: precedence (argument > env > client.toml > default) and the daemon's socket default."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorad.client import config as cfg
from lorad.client.errors import ConfigurationError


def test_precedence_argument_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "client.toml").write_text('token = "file-tok"\ntarget = "127.0.0.1:7000"\ntimeout_seconds = 7\n')
    s = cfg.resolve()
    assert (s.token, s.target, s.timeout_seconds) == ("file-tok", "127.0.0.1:7000", 7.0)
    assert s.token_source.endswith("client.toml")
    monkeypatch.setenv("LORAD_TOKEN", "env-tok")
    monkeypatch.setenv("LORAD_TARGET", "/run/x.sock")
    s = cfg.resolve()
    assert (s.token, s.target, s.token_source) == ("env-tok", "unix:///run/x.sock", "LORAD_TOKEN")
    s = cfg.resolve("localhost:1", "arg-tok", timeout_seconds=1)
    assert (s.token, s.target, s.timeout_seconds, s.token_source) == ("arg-tok", "localhost:1", 1, "argument")


def test_default_socket_mirrors_daemon_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("PREFIX", raising=False)
    assert cfg.default_socket_path() == tmp_path / ".local/share/lorad/run/lorad.sock"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert cfg.default_socket_path() == tmp_path / "xdg/lorad/run/lorad.sock"
    monkeypatch.setenv("LORAD_STORAGE_DATA_DIR", str(tmp_path / "dd"))
    assert cfg.default_socket_path() == tmp_path / "dd/run/lorad.sock"
    daemon_toml = tmp_path / "lorad.toml"
    daemon_toml.write_text(f'[server]\nsocket_path = "{tmp_path}/s.sock"\n')
    monkeypatch.setenv("LORAD_CONFIG", str(daemon_toml))
    assert cfg.default_socket_path() == tmp_path / "s.sock"
    assert cfg.resolve(data_dir=tmp_path / "other").target == f"unix://{tmp_path}/other/run/lorad.sock"


def test_default_matches_lorad_server_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server_config = pytest.importorskip("lorad.server.config")
    for env in ({}, {"XDG_DATA_HOME": str(tmp_path / "x")}, {"PREFIX": "/data/data/com.termux/files/usr"}):
        for k in ("XDG_DATA_HOME", "PREFIX"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert cfg.default_socket_path() == server_config.load_config(None).socket_path, env


def test_normalize_target() -> None:
    assert cfg.normalize_target("unix:/a/b.sock") == "unix:/a/b.sock"
    assert cfg.normalize_target("/a/b.sock") == "unix:///a/b.sock"
    assert cfg.normalize_target("127.0.0.1:50051") == "127.0.0.1:50051"


def test_save_token_roundtrip_is_private(tmp_path: Path) -> None:
    path = cfg.save_token('t"ok', target="/x.sock")
    assert path == tmp_path / "client.toml" and path.stat().st_mode & 0o777 == 0o600
    assert cfg.load_config_file() == {"token": 't"ok', "target": "/x.sock"}


def test_bad_config_file_reports_every_problem(tmp_path: Path) -> None:
    (tmp_path / "client.toml").write_text("token = 3\ntimeout_seconds = 'x'\n")
    with pytest.raises(ConfigurationError) as ei:
        cfg.resolve()
    assert "token = 3: must be a str" in str(ei.value) and "timeout_seconds" in str(ei.value)
    (tmp_path / "client.toml").write_text("token = \n")
    with pytest.raises(ConfigurationError, match="fix or delete"):
        cfg.resolve()


def test_owner_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="LORAD_OWNER_TOKEN"):
        cfg.read_owner_token(tmp_path)
    (tmp_path / "owner.token").write_text("own\n")
    assert cfg.read_owner_token(tmp_path) == "own"
    monkeypatch.setenv("LORAD_OWNER_TOKEN", "env-own")
    assert cfg.read_owner_token(tmp_path) == "env-own"


def test_data_dir_outranks_saved_and_env_target_and_keeps_the_saved_token_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    sock1 = f"unix://{d1}/run/lorad.sock"
    (tmp_path / "client.toml").write_text(f'token = "tok1"\ntarget = "{sock1}"\n')
    s = cfg.resolve(data_dir=d2)
    assert s.target == f"unix://{d2}/run/lorad.sock"
    assert s.token is None and s.token_source == ""  # tok1 belongs to d1's daemon: not sent to d2's
    assert cfg.resolve(data_dir=d1).token == "tok1"  # the saved target itself: its token applies
    monkeypatch.setenv("LORAD_TARGET", "127.0.0.1:9")
    assert cfg.resolve(data_dir=d2).target == f"unix://{d2}/run/lorad.sock"
    assert cfg.resolve("127.0.0.1:5", data_dir=d2).target == "127.0.0.1:5"  # --target beats --data-dir
    assert cfg.resolve().target == "127.0.0.1:9"


def test_owner_token_names_its_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORAD_OWNER_TOKEN", raising=False)
    (tmp_path / "owner.token").write_text("own\n")
    assert cfg.owner_token(tmp_path) == ("own", str(tmp_path / "owner.token"))
    monkeypatch.setenv("LORAD_OWNER_TOKEN", "env-own")
    assert cfg.owner_token(tmp_path) == ("env-own", "LORAD_OWNER_TOKEN")
