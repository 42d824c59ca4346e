"""The config file and `mlx-kvserve config show|path|init`: every value says where it came from,
and every problem in the file names the key, the file and the line."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_kvserve.config.file import ConfigError, key_lines, read_config_file
from mlx_kvserve.config.precedence import resolve_settings
from mlx_kvserve.config.setting_types import setting_types
from mlx_kvserve.config.settings import Settings

FIELDS = setting_types()


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLX_KVSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", *args],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=60,
    )


def test_show_names_the_source_of_every_value(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('# a comment\nport = 9001\n\nhost = "127.0.0.2"\nmax_queue = 3\n')
    env = {"MLX_KVSERVE_CONFIG": str(cfg), "MLX_KVSERVE_MAX_QUEUE": "4"}
    out = cli("config", "show", "--json", "--port", "9003", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    shown = json.loads(out.stdout)["settings"]
    assert shown["port"] == {"value": 9003, "source": "flag", "where": "--port"}
    assert shown["max_queue"] == {
        "value": 4,
        "source": "environment",
        "where": "MLX_KVSERVE_MAX_QUEUE",
    }
    assert shown["host"] == {"value": "127.0.0.2", "source": "file", "where": f"{cfg}, line 4"}
    assert shown["idle_timeout"] == {"value": 5.0, "source": "default", "where": None}
    assert set(shown) == set(Settings.option_names())
    table = cli("config", "show", env=env).stdout
    assert f"config file: {cfg}\n" in table
    assert any(
        line.split()[:2] == ["host", "127.0.0.2"] and f"file ({cfg}, line 4)" in line
        for line in table.splitlines()
    )


def test_show_hides_api_keys(tmp_path):
    env = {"MLX_KVSERVE_CONFIG": str(tmp_path / "none.toml"), "MLX_KVSERVE_API_KEY": "s3cret-k"}
    out = cli("config", "show", "--api-keys", "other-s3cret", env=env)
    assert out.returncode == 0
    assert "s3cret" not in out.stdout
    assert "(set)" in out.stdout


def test_path_follows_the_override(tmp_path):
    out = cli("config", "path", env={"MLX_KVSERVE_CONFIG": str(tmp_path / "c.toml")})
    assert out.stdout.strip() == str(tmp_path / "c.toml")


def test_init_writes_a_private_commented_file_of_defaults(tmp_path):
    cfg = tmp_path / "new-dir" / "config.toml"
    env = {"MLX_KVSERVE_CONFIG": str(cfg)}
    assert cli("config", "init", env=env).returncode == 0
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert stat.S_IMODE(cfg.parent.stat().st_mode) == 0o700
    text = cfg.read_text()
    assert read_config_file(cfg, FIELDS) == {}  # everything commented out
    for name in Settings.option_names():
        assert f"# {name} = " in text
    # Uncommenting every setting that has a default gives exactly the defaults.
    settings_lines = tuple(f"# {name} = " for name in Settings.option_names())
    uncommented = [
        line[2:] if line.startswith(settings_lines) and "(example" not in line else line
        for line in text.splitlines()
    ]
    cfg.write_text("\n".join(uncommented))
    resolved = resolve_settings({}, cfg)
    assert resolved.settings == Settings()
    assert {s.kind for s in resolved.sources.values()} == {"file", "default"}
    again = cli("config", "init", env=env)  # an existing file is kept
    assert again.returncode == 1 and "--force" in again.stdout
    assert cli("config", "init", "--force", env=env).returncode == 0


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ('host = "127.0.0.1"\nprot = 1\n', 2, "unknown setting 'prot' (did you mean 'port'?)"),
        ('\n\nport = "80"\n', 3, "setting 'port': expected an integer, got a string"),
        ("port = 70000\n", 1, "setting 'port': 70000 is not a TCP port"),
        ("no_cache = 1\n", 1, "setting 'no_cache': expected true or false"),
        ('log_level = "loud"\n', 1, "setting 'log_level'"),
        ('cache_budget = "lots"\n', 1, "setting 'cache_budget': not a size"),
        ("idle_timeout = -1\n", 1, "setting 'idle_timeout': must be positive"),
        ("shutdown_grace = nan\n", 1, "expected a finite number"),
        ('api_keys = ["a", 1]\n', 1, "setting 'api_keys': expected a string or an array"),
        ("port = 1\n\n[server]\nport = 2\n", 3, "unknown setting 'server'"),
        ("server.port = 2\n", 1, "unknown setting 'server'"),
        ('"por t" = 2\n', 1, "unknown setting 'por t'"),
    ],
)
def test_bad_file_names_key_file_and_line(tmp_path, text, line, needle):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        resolve_settings({}, cfg)
    assert str(err.value).startswith(f"{cfg}, line {line}: ")
    assert needle in str(err.value)
    out = cli("config", "show", env={"MLX_KVSERVE_CONFIG": str(cfg)})
    assert out.returncode == 1 and f"{cfg}, line {line}" in out.stdout
    serve = cli("serve", "--port", "0", env={"MLX_KVSERVE_CONFIG": str(cfg)})
    assert serve.returncode == 2 and f"{cfg}, line {line}" in serve.stderr


def test_invalid_toml_and_bad_environment_are_located(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text("port = 1\nhost = \n")
    with pytest.raises(ConfigError, match=r"config.toml: not valid TOML: .*line 2"):
        resolve_settings({}, cfg)
    cfg.write_bytes(b"host = '\xff'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        resolve_settings({}, cfg)
    monkeypatch.setenv("MLX_KVSERVE_NO_CACHE", "maybe")
    with pytest.raises(ConfigError, match="^MLX_KVSERVE_NO_CACHE: setting 'no_cache'"):
        resolve_settings({}, tmp_path / "absent.toml")
    monkeypatch.delenv("MLX_KVSERVE_NO_CACHE")
    with pytest.raises(ConfigError, match="^--prefill-step: setting 'prefill_step'"):
        resolve_settings({"prefill_step": 0}, tmp_path / "absent.toml")


def test_key_lines_ignore_keys_inside_tables():
    text = 'port = 1\n[tbl]\nhost = "x"\n[[arr]]\n"q" = 2\n'
    assert key_lines(text) == {"port": 1, "tbl": 2, "arr": 4}
    # Only \n ends a TOML line (found by the property test below: NEL inside a string).
    assert key_lines('host = "\x85\u2028"\nport = 1\n') == {"host": 1, "port": 2}


_values = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.text(max_size=5), max_size=3),
    st.lists(st.integers(), max_size=2),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(st.sampled_from([*FIELDS, "bogus", "Port"]), _values, max_size=4))
def test_any_typed_file_is_accepted_or_names_the_key_and_line(tmp_path, data):
    """Every TOML document of settings either loads or fails with a ConfigError that names a
    key it contains and the line that key is on; no other exception escapes."""
    from mlx_kvserve.config.file import toml_value

    cfg = tmp_path / "config.toml"
    lines = [f"{key} = {toml_value(value)}" for key, value in data.items()]
    try:
        cfg.write_text("\n".join(lines) + "\n")
        parsed_ok = True
    except UnicodeEncodeError:  # a lone surrogate cannot be written as UTF-8 at all
        parsed_ok = False
    if not parsed_ok:
        return
    try:
        resolve_settings({}, cfg)
    except ConfigError as exc:
        message = str(exc)
        if "not valid TOML" in message:
            return  # e.g. nan/inf spelled by repr(); tomllib's own message has the line
        named = re.search(r"setting '([^']*)'", message)
        assert named and named.group(1) in data, message
        line = list(data).index(named.group(1)) + 1
        assert message.startswith(f"{cfg}, line {line}: "), message


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "replace")))
def test_arbitrary_bytes_never_escape_as_another_exception(tmp_path, raw):
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(raw)
    try:
        read_config_file(cfg, FIELDS)
    except ConfigError as exc:
        assert str(cfg) in str(exc)


def test_a_config_directory_is_reported_not_crashed_on(tmp_path: Path):
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_settings({}, tmp_path)
