"""training.allocator: when `lorad serve` re-executes itself with tcmalloc preloaded, and what it refuses."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from lorad.server import allocator
from lorad.server.allocator import AllocatorError, find_tcmalloc, preload_env
from lorad.server.config import ConfigError, build_config, serve_config

GLIBC = platform.libc_ver()[0] == "glibc"


def _lib(tmp_path: Path, name: str = "libtcmalloc_minimal.so.4") -> Path:
    lib = tmp_path / name
    lib.write_bytes(b"\x7fELF")
    return lib


def test_find_tcmalloc_takes_the_minimal_library_first(tmp_path: Path) -> None:
    assert find_tcmalloc((str(tmp_path),)) is None
    full = _lib(tmp_path, "libtcmalloc.so.4")
    assert find_tcmalloc((str(tmp_path),)) == full
    minimal = _lib(tmp_path)
    assert find_tcmalloc((str(tmp_path / "missing"), str(tmp_path))) == minimal


@pytest.mark.skipif(not GLIBC, reason="tcmalloc is preloaded on glibc only")
def test_auto_preloads_the_library_and_keeps_other_preloads(tmp_path: Path) -> None:
    lib = _lib(tmp_path)
    env = preload_env("auto", {"PATH": "/bin"}, lib=lib)
    assert env == {"PATH": "/bin", "LD_PRELOAD": str(lib)}
    env = preload_env("tcmalloc", {"LD_PRELOAD": "/opt/libother.so"}, lib=lib)
    assert env is not None and env["LD_PRELOAD"] == f"{lib}:/opt/libother.so"


def test_no_reexec_when_asked_for_system_or_already_preloaded(tmp_path: Path) -> None:
    lib = _lib(tmp_path)
    assert preload_env("system", {}, lib=lib) is None
    # The re-executed process sees its own LD_PRELOAD: it never re-executes again; a malloc the user preloaded stays.
    assert preload_env("auto", {"LD_PRELOAD": str(lib)}, lib=lib) is None
    assert preload_env("auto", {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, lib=lib) is None


def test_missing_library_is_fine_for_auto_and_an_error_for_tcmalloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: None)
    assert preload_env("auto", {}) is None
    with pytest.raises(AllocatorError, match="libtcmalloc-minimal4"):
        preload_env("tcmalloc", {})


def test_config_names_a_bad_allocator_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"training.allocator='jemalloc': must be one of auto, tcmalloc, system"):
        build_config({"training": {"allocator": "jemalloc"}}, env={})
    assert build_config({}, env={"LORAD_TRAINING_ALLOCATOR": "system"}).training.allocator == "system"


def test_serve_flags_override_the_file_and_the_environment(tmp_path: Path) -> None:
    cfg_file = tmp_path / "lorad.toml"
    cfg_file.write_text(f'[storage]\ndata_dir = "{tmp_path / "file"}"\n[training]\nallocator = "system"\n')
    env = {"LORAD_SERVER_TCP_ADDRESS": "127.0.0.1:1"}
    argv = ["--config", str(cfg_file), "--data-dir", str(tmp_path / "flag"), "--tcp", "127.0.0.1:2"]
    cfg = serve_config(argv, env)
    got = (cfg.data_dir, cfg.server.tcp_address, cfg.training.allocator)
    assert got == (tmp_path / "flag", "127.0.0.1:2", "system")
    assert serve_config(["--config", str(cfg_file)], env).server.tcp_address == "127.0.0.1:1"


def test_entry_refuses_a_required_tcmalloc_it_cannot_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: None)
    cfg = tmp_path / "lorad.toml"
    cfg.write_text('[training]\nallocator = "tcmalloc"\n')
    assert allocator.reexec_with_allocator(["--config", str(cfg)]) == 2
    assert "install the package libtcmalloc-minimal4" in capsys.readouterr().err
    cfg.write_text('[training]\nallocator = "auto"\n')
    assert allocator.reexec_with_allocator(["--config", str(cfg)]) is None  # goes on under the system's malloc
    cfg.write_text("[training]\nallocator = 3\n")
    assert allocator.reexec_with_allocator(["--config", str(cfg)]) is None  # the daemon's start reports it
