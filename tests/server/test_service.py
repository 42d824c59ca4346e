"""`mlx-kvserve service ...`: the files it writes and the exact commands it runs.

Only the boundary that executes launchctl/systemctl/journalctl (service.runner) is replaced, by a
recorder; files are really written (under a temporary home) and read back with plistlib or as
text. Where a user systemd is running, the real thing is tested too.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.cli import build_parser
from mlx_kvserve.cli.service_commands import run_service_command
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.service import manage
from mlx_kvserve.service.actions import ServiceError, execute
from mlx_kvserve.service.launchd import Launchd
from mlx_kvserve.service.runner import Result
from mlx_kvserve.service.spec import build_spec
from mlx_kvserve.service.systemd import Systemd, quote, unquote_line

PY = "/opt/venv/bin/python3"


class Recorder:
    """The runner boundary, recording each command; `answers` scripts some results."""

    def __init__(self, answers: dict[tuple[str, ...], Result] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.answers = answers or {}

    def run(self, argv):
        self.calls.append(tuple(argv))
        return self.answers.get(tuple(argv), Result(0, ""))

    def stream(self, argv):
        self.calls.append(tuple(argv))
        return 0


def spec(flags: dict | None = None, env: dict | None = None, settings: Settings | None = None):
    return build_spec(
        "mlx-kvserve",
        flags or {},
        settings or Settings(),
        environ=env or {"MLX_KVSERVE_CONFIG": "/cfg/config.toml", "HOME": "/h"},
        python=PY,
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ================================================================ launchd ===================
def test_launchd_install_writes_the_plist_and_bootstraps_it(tmp_path):
    agent = Launchd("mlx-kvserve", home=tmp_path, uid=501)
    rec = Recorder()
    flags = {"port": 9123, "no_cache": True, "allowed_hosts": ["a.test", "b.test"], "api_key": "K"}
    execute(agent.install(spec(flags)), rec, dry_run=False, say=lambda _: None)
    plist = tmp_path / "Library" / "LaunchAgents" / "io.github.mlx-kvserve.plist"
    assert mode(plist) == 0o600
    doc = plistlib.loads(plist.read_bytes())
    log = str(tmp_path / "Library" / "Logs" / "mlx-kvserve" / "mlx-kvserve.log")
    assert doc == {
        "Label": "io.github.mlx-kvserve",
        "ProgramArguments": [
            PY,
            "-m",
            "mlx_kvserve",
            "serve",
            "--port",
            "9123",
            "--no-cache",
            "--allowed-hosts",
            "a.test",
            "--allowed-hosts",
            "b.test",
        ],  # fmt: skip
        "EnvironmentVariables": {
            "MLX_KVSERVE_CONFIG": "/cfg/config.toml",
            "PYTHONUNBUFFERED": "1",
            "MLX_KVSERVE_API_KEY": "K",  # the key is in the 0600 file, never in argv (ps)
        },
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        "ProcessType": "Interactive",
        "ExitTimeOut": 30,
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }
    assert mode(Path(log).parent) == 0o700
    assert rec.calls == [
        ("launchctl", "enable", "gui/501/io.github.mlx-kvserve"),
        ("launchctl", "bootstrap", "gui/501", str(plist)),
    ]
    # Installing again with other options updates the file and reloads the job in place.
    rec.calls.clear()
    execute(agent.install(spec({"port": 9124})), rec, dry_run=False, say=lambda _: None)
    assert plistlib.loads(plist.read_bytes())["ProgramArguments"][-2:] == ["--port", "9124"]
    assert rec.calls == [
        ("launchctl", "bootout", "gui/501/io.github.mlx-kvserve"),
        ("launchctl", "enable", "gui/501/io.github.mlx-kvserve"),
        ("launchctl", "bootstrap", "gui/501", str(plist)),
    ]


def test_launchd_start_stop_restart_uninstall_commands(tmp_path):
    agent = Launchd("mlx-kvserve", home=tmp_path, uid=501)
    target = "gui/501/io.github.mlx-kvserve"
    assert agent.start().commands() == [
        ("launchctl", "bootstrap", "gui/501", str(agent.path)),
        ("launchctl", "kickstart", target),
    ]
    assert agent.stop().commands() == [("launchctl", "kill", "SIGTERM", target)]
    assert agent.restart().commands() == [("launchctl", "kickstart", "-k", target)]
    execute(agent.install(spec()), Recorder(), dry_run=False, say=lambda _: None)
    rec = Recorder({("launchctl", "bootout", target): Result(3, "Boot-out failed: 3")})
    execute(agent.uninstall(), rec, dry_run=False, say=lambda _: None)  # not loaded: fine
    assert rec.calls == [("launchctl", "bootout", target)]
    assert not agent.path.exists()


def test_a_failing_command_stops_the_plan_with_its_output(tmp_path):
    agent = Launchd("mlx-kvserve", home=tmp_path, uid=501)
    argv = ("launchctl", "bootstrap", "gui/501", str(agent.path))
    rec = Recorder({argv: Result(5, "Bootstrap failed: 5: Input/output error")})
    with pytest.raises(ServiceError, match="Input/output error"):
        execute(agent.install(spec()), rec, dry_run=False, say=lambda _: None, sleep=lambda _: 0)
    assert rec.calls.count(argv) == 4  # retried: it can race the previous instance's bootout


def test_launchd_status_parses_launchctl_print(tmp_path):
    agent = Launchd("mlx-kvserve", home=tmp_path, uid=501)
    printed = "gui/501/io.github.mlx-kvserve = {\n\tstate = running\n\tpid = 4242\n}\n"
    assert agent.parse_status(Result(0, printed)) == (True, 4242)
    assert agent.parse_status(Result(0, printed.replace("running", "not running"))) == (True, None)
    assert agent.parse_status(Result(113, "Could not find service")) == (False, None)


# ================================================================ systemd ===================
def test_systemd_install_writes_the_unit_and_enables_it(tmp_path):
    unit = Systemd("mlx-kvserve", config_home=tmp_path)
    rec = Recorder()
    flags = {"port": 9123, "served_model_name": ["gpt-4o", "my model"], "api_keys": ["k1", "k2"]}
    env = {"MLX_KVSERVE_CONFIG": "/cfg/100%.toml", "MLX_KVSERVE_CACHE_DIR": "/c/$HOME dir"}
    execute(unit.install(spec(flags, env)), rec, dry_run=False, say=lambda _: None)
    path = tmp_path / "systemd" / "user" / "mlx-kvserve.service"
    assert mode(path) == 0o600
    text = path.read_text()
    assert "\nRestart=on-failure\n" in text
    assert "\nTimeoutStopSec=30\n" in text
    assert "\nWantedBy=default.target\n" in text
    assert "StandardOutput" not in text  # the journal
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line == (
        f"ExecStart={PY} -m mlx_kvserve serve --port 9123 --served-model-name gpt-4o "
        '--served-model-name "my model"'
    )
    argv, environment = unit.installed_command()
    assert argv == [PY, "-m", "mlx_kvserve", "serve", "--port", "9123"] + [
        "--served-model-name",
        "gpt-4o",
        "--served-model-name",
        "my model",
    ]
    assert environment == {
        "MLX_KVSERVE_CACHE_DIR": "/c/$HOME dir",
        "MLX_KVSERVE_CONFIG": "/cfg/100%.toml",
        "PYTHONUNBUFFERED": "1",
        "MLX_KVSERVE_API_KEYS": "k1,k2",
    }
    assert 'Environment="MLX_KVSERVE_CACHE_DIR=/c/$HOME dir"' in text  # no $ expansion there
    assert "Environment=MLX_KVSERVE_CONFIG=/cfg/100%%.toml" in text  # % is a specifier
    assert rec.calls == [
        ("systemctl", "--user", "daemon-reload"),
        ("systemctl", "--user", "enable", "--now", "mlx-kvserve.service"),
    ]
    rec.calls.clear()
    execute(unit.install(spec({"port": 9124})), rec, dry_run=False, say=lambda _: None)
    assert "--port 9124" in path.read_text()
    assert rec.calls == [
        ("systemctl", "--user", "daemon-reload"),
        ("systemctl", "--user", "enable", "mlx-kvserve.service"),
        ("systemctl", "--user", "restart", "mlx-kvserve.service"),
    ]
    rec.calls.clear()
    execute(unit.uninstall(), rec, dry_run=False, say=lambda _: None)
    assert not path.exists()
    assert rec.calls == [
        ("systemctl", "--user", "disable", "--now", "mlx-kvserve.service"),
        ("systemctl", "--user", "daemon-reload"),
    ]


def test_systemd_actions_and_logs_commands(tmp_path):
    unit = Systemd("kv2", config_home=tmp_path)
    assert unit.start().commands() == [("systemctl", "--user", "start", "kv2.service")]
    assert unit.stop().commands() == [("systemctl", "--user", "stop", "kv2.service")]
    assert unit.restart().commands() == [("systemctl", "--user", "restart", "kv2.service")]
    rec = Recorder()
    assert manage.logs(unit, rec, 20, True) == 0
    assert rec.calls == [
        ("journalctl", "--user", "--unit", "kv2.service", "--lines", "20", "--no-pager", "--follow")
    ]


@given(st.text(alphabet=st.characters(blacklist_characters="\n\r\0"), max_size=40))
def test_systemd_quoting_round_trips(word):
    assert unquote_line(quote(word)) == [word]
    assert unquote_line(quote(word, exec_line=False), exec_line=False) == [word]


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    argv = spec({"cache_dir": "kv", "model": ["my-model"]}).program
    assert argv[-4:] == ["--model", str(tmp_path / "my-model"), "--cache-dir", str(tmp_path / "kv")]
    assert spec({"model": ["org/repo-id"]}).program[-2:] == ["--model", "org/repo-id"]
    named = spec({"model": ["small=my-model", "big=org/repo-id"]}).program
    assert named[-4:] == ["--model", f"small={tmp_path / 'my-model'}", "--model", "big=org/repo-id"]


def test_a_job_service_runs_serve_with_the_hostfile_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.json").write_text("[]")
    argv = spec({"hostfile": "hosts.json", "ring_port": 40000}).program
    assert argv[3] == "serve" and "--hostfile" in argv
    assert argv[argv.index("--hostfile") + 1] == str(tmp_path / "hosts.json")
    assert argv[argv.index("--ring-port") + 1] == "40000"


def test_line_breaks_cannot_be_injected_into_a_unit(tmp_path):
    unit = Systemd("mlx-kvserve", config_home=tmp_path)
    with pytest.raises(ValueError, match="line break"):
        unit.render(spec({"model": "x\nExecStartPre=/bin/evil"}))


# ================================================================ the command line ==========
def run_cli(*argv: str, runner=None) -> int:
    return run_service_command(build_parser().parse_args(["service", *argv]), runner=runner)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
    monkeypatch.setenv("MLX_KVSERVE_CONFIG", str(tmp_path / "cfg.toml"))
    for key in [
        k for k in os.environ if k.startswith("MLX_KVSERVE_") and k != "MLX_KVSERVE_CONFIG"
    ]:
        monkeypatch.delenv(key)
    return tmp_path


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["launchd", "systemd"])
def test_dry_run_prints_file_and_commands_and_changes_nothing(home, kind):
    clean = {k: v for k, v in os.environ.items() if k != "MLX_KVSERVE_API_KEY"}
    before = files_under(home)
    out = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "service", "install", "--manager", kind,
         "--dry-run", "--port", "9555", "--api-key", "top-secret-key"],
        capture_output=True, text=True, env=clean, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert files_under(home) == before
    assert "top-secret-key" not in out.stdout and "<hidden>" in out.stdout
    if kind == "launchd":
        assert "<key>KeepAlive</key>" in out.stdout
        assert "# would run: launchctl bootstrap gui/" in out.stdout
    else:
        assert "Restart=on-failure" in out.stdout
        assert "# would run: systemctl --user enable --now mlx-kvserve.service" in out.stdout
    assert "--port</string>" in out.stdout or "--port 9555" in out.stdout


def test_the_other_manager_only_with_dry_run(home, capsys):
    other = "systemd" if manage.default_manager() == "launchd" else "launchd"
    rec = Recorder()
    assert run_cli("start", "--manager", other, runner=rec) == 2
    assert "--dry-run" in capsys.readouterr().out and rec.calls == []


def test_bad_options_fail_before_anything_is_written(home, capsys):
    rec = Recorder()
    assert run_cli("install", "--manager", "systemd", "--dry-run", "--name", "../x") == 2
    (home / "cfg.toml").write_text("prot = 1\n")
    assert run_cli("install", "--dry-run", "--manager", "systemd", runner=rec) == 1
    assert "cfg.toml, line 1: unknown setting 'prot'" in capsys.readouterr().out
    assert rec.calls == [] and files_under(home) == [home / "cfg.toml"]


@pytest.mark.skipif(manage.default_manager() is None, reason="no service manager on this platform")
def test_install_through_the_cli_uses_this_interpreter(home):
    rec = Recorder()
    assert run_cli("install", "--port", "9777", runner=rec) == 0
    manager = manage.make_manager(manage.default_manager(), "mlx-kvserve")
    argv, env = manager.installed_command()
    assert argv == [sys.executable, "-m", "mlx_kvserve", "serve", "--port", "9777"]
    assert env["MLX_KVSERVE_CONFIG"] == str(home / "cfg.toml")
    assert len(rec.calls) == 2 and rec.calls[-1][0] in ("launchctl", "systemctl")


def test_status_reports_pid_health_log_and_cache(tmp_path, start_server, capsys):
    cache = tmp_path / "cache"
    server = start_server(env={"MLX_KVSERVE_CACHE_DIR": str(cache)})
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).is_success
    unit = Systemd("mlx-kvserve", config_home=tmp_path)
    env = {"MLX_KVSERVE_CACHE_DIR": str(cache), "MLX_KVSERVE_CONFIG": str(tmp_path / "no.toml")}
    execute(unit.install(spec({"port": server.port}, env)), Recorder(), dry_run=False, say=print)
    capsys.readouterr()
    shown = f"LoadState=loaded\nActiveState=active\nSubState=running\nMainPID={server.proc.pid}\n"
    rec = Recorder({unit.status_command(): Result(0, shown)})
    assert manage.status(unit, rec) == 0
    out = capsys.readouterr().out
    assert f"running:   yes, pid {server.proc.pid}" in out
    assert f"health:    ok (http://127.0.0.1:{server.port}/health" in out
    assert f"cache:     {cache} (" in out and "empty" not in out
    stopped = Recorder({unit.status_command(): Result(0, "LoadState=loaded\nMainPID=0\n")})
    assert manage.status(unit, stopped) == 3
    assert "running:   no" in capsys.readouterr().out
    unit.path.unlink()
    assert manage.status(unit, stopped) == 3
    assert "installed: no" in capsys.readouterr().out


def test_launchd_logs_print_the_last_lines(tmp_path, capsys):
    agent = Launchd("mlx-kvserve", home=tmp_path, uid=501)
    agent.log_path.parent.mkdir(parents=True)
    agent.log_path.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert manage.logs(agent, Recorder(), 3, False) == 0
    assert capsys.readouterr().out == "line 99997\nline 99998\nline 99999\n"


# ================================================================ the real systemd ==========
def _user_systemd() -> str | None:
    """Why the real-systemd test cannot run here, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "systemd is Linux-only"
    if not shutil.which("systemctl"):
        return "no systemctl"
    state = subprocess.run(
        ["systemctl", "--user", "is-system-running"], capture_output=True, text=True
    )
    if state.stdout.strip() not in ("running", "degraded"):
        return f"no user systemd session here ({state.stdout.strip() or state.stderr.strip()})"
    return None


@pytest.mark.skipif(_user_systemd() is not None, reason=str(_user_systemd()))
def test_real_systemd_restarts_after_sigkill_and_serves_from_disk(tmp_path):
    """Install a uniquely named unit for real, SIGKILL its server, and check that systemd
    restarts it (Restart=on-failure) and that the conversation comes back from the disk."""
    from tests.server.test_metrics import wait_for_writes
    from tests.support.servers import free_port

    name = f"mlx-kvserve-test-{os.getpid()}"
    port = free_port()
    env = {**os.environ, "MLX_KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    env["MLX_KVSERVE_CONFIG"] = str(tmp_path / "none.toml")
    cmd = [sys.executable, "-m", "mlx_kvserve", "service"]
    install = [*cmd, "install", "--name", name, "--port", str(port)]
    subprocess.run(install, env=env, check=True, timeout=120)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_health(base)
        messages = [
            {"role": "system", "content": "You are terse. " * 30},
            {"role": "user", "content": "Name a colour."},
        ]
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        first = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        wait_for_writes(base)
        pid = int(
            subprocess.run(
                ["systemctl", "--user", "show", f"{name}.service", "--property=MainPID"],
                capture_output=True, text=True, check=True,
            ).stdout.split("=")[1]
        )  # fmt: skip
        os.kill(pid, signal.SIGKILL)
        _wait_health(base)  # systemd restarted it
        again = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        subprocess.run([*cmd, "uninstall", "--name", name], env=env, timeout=120)


def _wait_health(base: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{base} did not come back")


def test_no_user_systemd_is_explained(tmp_path):
    unit = Systemd("mlx-kvserve", config_home=tmp_path)
    reload = ("systemctl", "--user", "daemon-reload")
    rec = Recorder({reload: Result(1, "Failed to connect to bus: No medium found\n")})
    with pytest.raises(ServiceError, match="no user systemd here"):
        execute(unit.install(spec()), rec, dry_run=False, say=lambda _: None)
    assert rec.calls == [reload]  # nothing runs after the first failure
