"""The CLI explains itself, and settings follow flags > environment > config file > defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_kvserve.config.precedence import load_settings
from mlx_kvserve.config.settings import Settings


def test_serve_help_lists_every_option_with_its_env_var():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in Settings.option_names():
        assert "--" + name.replace("_", "-") in out
        assert "MLX_KVSERVE_" + name.upper() in out


def test_console_script_and_module_agree():
    mod = subprocess.run([sys.executable, "-m", "mlx_kvserve", "--version"], capture_output=True)
    assert mod.returncode == 0 and b"mlx-kvserve" in mod.stdout


def test_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text('port = 9001\nhost = "0.0.0.0"\nmax_queue = 3\napi_key = "file"\n')
    monkeypatch.setenv("MLX_KVSERVE_PORT", "9002")
    monkeypatch.setenv("MLX_KVSERVE_MAX_QUEUE", "4")
    settings = load_settings({"port": 9003}, cfg)
    assert settings.port == 9003  # flag beats env and file
    assert settings.max_queue == 4  # env beats file
    assert settings.host == "0.0.0.0"  # file beats default
    assert settings.api_key == "file"
    assert settings.keepalive_seconds == Settings().keepalive_seconds  # default


def test_defaults_are_safe(tmp_path):
    settings = load_settings({}, tmp_path / "missing.toml")
    assert settings.host == "127.0.0.1"
    assert settings.api_key is None


def test_bad_values_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_PORT", "eighty")
    with pytest.raises(ValueError, match="port"):
        load_settings({}, tmp_path / "missing.toml")
    monkeypatch.delenv("MLX_KVSERVE_PORT")
    cfg = tmp_path / "config.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_settings({}, cfg)


def test_negative_blas_threads_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_BLAS_THREADS", "-1")
    with pytest.raises(ValueError, match="blas_threads"):
        load_settings({}, tmp_path / "missing.toml")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
@pytest.mark.parametrize(("args", "env", "want"), [(["--blas-threads", "2"], "1", 2), ([], "1", 1)])
def test_blas_threads_setting_reaches_openblas(start_server, args, env, want):
    """--blas-threads wins over OPENBLAS_NUM_THREADS; without it the environment is kept."""
    server = start_server(*args, env={"OPENBLAS_NUM_THREADS": env})
    assert f", {want} threads)" in server.log()
