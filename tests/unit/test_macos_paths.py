"""Every macOS branch of the package, run here on Linux with the OS's answers faked at the seams
in mlx_kvserve.macos (`on_macos`, `fcntl`, `sysctl_int`, `metal_working_set`) and nowhere else:
F_FULLFSYNC for every durable write, F_RDADVISE for prompt-cache read-ahead, the sysctl memory
pressure level, Metal's wired limit and working set, the open-file ceiling, launchd, and the
quantized default model.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve import durable, macos
from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.disk import RADVISORY, DiskTier
from mlx_kvserve.chat.reasoning.seal_key import KEY_FILE, install_key
from mlx_kvserve.cli import build_parser
from mlx_kvserve.cli.service_commands import run_service_command
from mlx_kvserve.config.file import write_private
from mlx_kvserve.engine.ledger import default_budget
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.models import budget, precision, pressure
from mlx_kvserve.models.default_model import SMOLLM2, default_variant
from mlx_kvserve.models.manifest import write_manifest
from mlx_kvserve.net.resources import DARWIN_FD_MAX, fd_ceiling, raise_fd_limit
from mlx_kvserve.service import manage
from mlx_kvserve.service.actions import write_file
from mlx_kvserve.service.runner import Result
from tests.support.cache_testing import kv_arrays, make_kv

GiB = 1 << 30


class FcntlRecorder:
    """macos.fcntl as the test's kernel: records (command, inode, argument); `error` refuses."""

    def __init__(self, error: OSError | None = None) -> None:
        self.calls: list[tuple[int, int, int | bytes]] = []
        self.error = error

    def __call__(self, fd: int, command: int, arg: int | bytes = 0) -> int | bytes:
        self.calls.append((command, os.fstat(fd).st_ino, arg))
        if self.error is not None:
            raise self.error
        return arg

    def inodes(self, command: int) -> list[int]:
        return [inode for cmd, inode, _ in self.calls if cmd == command]


@pytest.fixture
def mac(monkeypatch: pytest.MonkeyPatch) -> FcntlRecorder:
    """This process is a Mac: macOS's Python surface for read-ahead, and its fcntl recorded."""
    recorder = FcntlRecorder()
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    monkeypatch.setattr(macos, "fcntl", recorder)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    return recorder


# -- F_FULLFSYNC ------------------------------------------------------------------------------
def test_fsync_is_a_full_fsync_on_macos(mac: FcntlRecorder, tmp_path) -> None:
    durable.fsync_path(tmp_path)
    assert mac.inodes(macos.F_FULLFSYNC) == [tmp_path.stat().st_ino]


@pytest.mark.parametrize("refusal", [OSError(45, "not supported"), None])
def test_a_refused_full_fsync_falls_back_to_fsync(monkeypatch, tmp_path, refusal) -> None:
    """A file system that refuses F_FULLFSYNC gets a plain fsync; with no fake, the real
    fcntl on Linux refuses macOS's command number the same way."""
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    if refusal is not None:
        monkeypatch.setattr(macos, "fcntl", FcntlRecorder(refusal))
    path = tmp_path / "f"
    path.write_bytes(b"x")
    durable.fsync_path(path)  # no error: fsync took over


def _seal_key(tmp_path):
    install_key(tmp_path)
    return tmp_path / KEY_FILE


def _config(tmp_path):
    path = tmp_path / "cfg" / "config.toml"
    write_private(path, "port = 1\n", overwrite=False)
    write_private(path, "port = 2\n", overwrite=True)
    assert path.read_text() == "port = 2\n"
    return path


def _service_file(tmp_path):
    path = tmp_path / "LaunchAgents" / "io.github.mlx-kvserve.plist"
    write_file(path, b"<plist/>")
    return path


def _cache_marker(tmp_path):
    tier = DiskTier(tmp_path, "model-a", logging.getLogger("test"))
    tier.write_marker("run")
    tier.release_lock()
    return tmp_path / "model-a" / "RUNNING"


def _manifest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_manifest(tmp_path, {"converter": 1})
    return tmp_path / "manifest.json"


@pytest.mark.parametrize(
    "write", [_seal_key, _config, _service_file, _cache_marker, _manifest], ids=lambda f: f.__name__
)
def test_small_state_files_are_fsynced_with_their_directory(mac, tmp_path, write) -> None:
    """Each small state file reaches the drive, and so does the directory entry naming it."""
    path = write(tmp_path)
    synced = mac.inodes(macos.F_FULLFSYNC)
    assert path.stat().st_ino in synced
    assert path.parent.stat().st_ino in synced
    assert path.stat().st_mode & 0o077 == 0
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


# -- F_RDADVISE -------------------------------------------------------------------------------
def _tier_with_files(tmp_path, sizes: dict[str, int]) -> DiskTier:
    tier = DiskTier(tmp_path, "model-a", logging.getLogger("test"))
    for key, size in sizes.items():
        tier.path(key).write_bytes(b"k" * size)
    return tier


def test_read_ahead_is_f_rdadvise_on_macos(mac: FcntlRecorder, tmp_path) -> None:
    tier = _tier_with_files(tmp_path, {"a" * 64: 1000, "b" * 64: 3})
    tier.prefetch(["a" * 64, "b" * 64, "c" * 64])  # the third is gone: skipped
    advised = [(inode, arg) for cmd, inode, arg in mac.calls if cmd == macos.F_RDADVISE]
    assert [(i, struct.unpack(RADVISORY, a)) for i, a in advised] == [
        (tier.path("a" * 64).stat().st_ino, (0, 1000)),
        (tier.path("b" * 64).stat().st_ino, (0, 3)),
    ]
    assert struct.calcsize(RADVISORY) == 16  # sizeof(struct radvisory) on 64-bit macOS
    tier.release_lock()


@pytest.mark.parametrize("error", [OSError(22, "refused"), RuntimeError("anything")])
def test_a_refused_read_ahead_never_fails(monkeypatch, tmp_path, error) -> None:
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    monkeypatch.setattr(macos, "fcntl", FcntlRecorder(error))
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    tier = _tier_with_files(tmp_path, {"a" * 64: 10})
    tier.prefetch(["a" * 64])
    monkeypatch.undo()  # the real fcntl: Linux refuses macOS's command number
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    tier.prefetch(["a" * 64])
    monkeypatch.setattr(macos, "on_macos", lambda: False)  # neither call: nothing to do
    tier.prefetch(["a" * 64])
    tier.release_lock()


def test_a_chain_of_small_links_restores_from_disk_on_macos(mac: FcntlRecorder, tmp_path) -> None:
    """The conversation continued after a restart: its short links are read ahead with
    F_RDADVISE (macOS's Python has no posix_fadvise) and restored exactly."""
    tokens = list(range(2000, 2400))
    pc = PromptCache(tmp_path, "model-a", disk_budget=64 << 20, ram_budget=64 << 20)
    for n in (100, 200, 300):
        pc.checkpoint(tokens[:n], make_kv(n), "message")
    pc.close()
    pc = PromptCache(tmp_path, "model-a", disk_budget=64 << 20, ram_budget=0)
    match = pc.lookup(tokens[:301])
    caches = [KVCache(), KVCache()]
    pc.restore(match, caches, tokens=tokens[:301])
    assert match.source == "disk" and match.usable == 300
    for a, b in zip(kv_arrays(caches), kv_arrays(make_kv(300)), strict=True):
        assert (a == b).all()
    assert len(mac.inodes(macos.F_RDADVISE)) == 3
    pc.close()


# -- memory pressure: sysctl ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "level"),
    [(1, pressure.NORMAL), (2, pressure.WARN), (4, pressure.CRITICAL), (3, pressure.NORMAL)],
)
def test_pressure_is_read_from_sysctl_on_macos(monkeypatch, value, level) -> None:
    names = []
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    monkeypatch.setattr(macos, "sysctl_int", lambda name: names.append(name) or value)
    source = pressure.pressure_source({})
    assert source is not None and source.name == "sysctl kern.memorystatus_vm_pressure_level"
    assert source.read() == level
    assert names == ["kern.memorystatus_vm_pressure_level"]


def test_an_unreadable_sysctl_reads_normal(monkeypatch) -> None:
    """Linux's libc has no sysctlbyname: the real reader answers None, read as normal."""
    assert macos.sysctl_int("kern.memorystatus_vm_pressure_level") is None
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    source = pressure.pressure_source({})
    assert source is not None and source.read() == pressure.NORMAL


# -- Metal: wired limit, working set ----------------------------------------------------------
@pytest.fixture
def metal(monkeypatch: pytest.MonkeyPatch) -> int:
    """Metal recommends a 16 GiB working set."""
    monkeypatch.setattr(macos, "metal_working_set", lambda: 16 * GiB)
    return 16 * GiB


def test_metal_wired_limit_is_set_and_put_back(metal: int, caplog) -> None:
    model = {"w": mx.zeros((1024,), dtype=mx.float32)}  # 4 KiB of weights
    policy = MemoryPolicy(cache_limit=1 << 20)
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.engine"):
        policy.start(model)
    assert policy.stats()["mlx_wired_limit_set"]
    assert "wired limit 16.0 GiB" in caplog.text and "close to" not in caplog.text
    assert policy.default_kv_budget(model) == default_budget(metal, 4096)
    policy.stop()
    assert not policy.stats()["mlx_wired_limit_set"]


def test_a_model_near_the_working_set_is_warned_about(monkeypatch, caplog) -> None:
    monkeypatch.setattr(macos, "metal_working_set", lambda: 4000)
    policy = MemoryPolicy(cache_limit=0)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.engine"):
        policy.start({"w": mx.zeros((1024,), dtype=mx.float32)})
    assert "close to the 0 MB this machine can keep resident" in caplog.text
    policy.stop()


def test_metal_sizes_the_budgets_and_the_kv_dtype(metal: int) -> None:
    assert budget.system_memory() == metal
    assert budget.memory_budget("auto") == int(metal * budget.AUTO_SHARE)
    assert precision.on_metal()
    assert precision.resolve_kv_dtype("auto", metal=precision.on_metal()) == "float16"


def test_macos_without_metal_uses_ram(monkeypatch) -> None:
    """The real question to MLX, asked on a 'Mac' whose MLX has no Metal device (this one)."""
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    assert macos.metal_working_set() is None
    assert not precision.on_metal()
    assert budget.system_memory() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# -- open files, service manager, default model -----------------------------------------------
def test_open_file_limit_stops_at_macos_ceiling(monkeypatch) -> None:
    assert fd_ceiling(65536, resource.RLIM_INFINITY) == 65536
    assert fd_ceiling(65536, 20000) == 20000
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    assert fd_ceiling(65536, resource.RLIM_INFINITY) == DARWIN_FD_MAX
    assert fd_ceiling(65536, 20000) == DARWIN_FD_MAX
    assert fd_ceiling(4096, 20000) == 4096
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:  # the real limit, raised as far as this process's hard limit allows
        assert raise_fd_limit(65536) == min(hard, DARWIN_FD_MAX)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Recorder:
    """The service runner boundary (launchctl), recording each command."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv):
        self.calls.append(tuple(argv))
        return Result(0, "")

    def stream(self, argv):
        self.calls.append(tuple(argv))
        return 0


def test_the_service_is_a_launchd_agent_on_macos(mac, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MLX_KVSERVE_CONFIG", str(tmp_path / "cfg.toml"))
    assert manage.default_manager() == "launchd"
    runner = Recorder()
    args = build_parser().parse_args(["service", "install", "--port", "9777"])
    assert run_service_command(args, runner=runner) == 0
    plist = tmp_path / "Library" / "LaunchAgents" / "io.github.mlx-kvserve.plist"
    assert plist.stat().st_mode & 0o777 == 0o600
    assert plist.stat().st_ino in mac.inodes(macos.F_FULLFSYNC)
    uid = os.getuid()
    assert runner.calls == [
        ("launchctl", "enable", f"gui/{uid}/io.github.mlx-kvserve"),
        ("launchctl", "bootstrap", f"gui/{uid}", str(plist)),
    ]
    argv, _env = manage.make_manager("launchd", "mlx-kvserve").installed_command()
    assert argv == [sys.executable, "-m", "mlx_kvserve", "serve", "--port", "9777"]


def test_the_default_model_is_quantized_on_macos(monkeypatch, tmp_path) -> None:
    assert default_variant() == "f32"
    monkeypatch.setattr(macos, "on_macos", lambda: True)
    assert default_variant() == "q4_1"
    assert SMOLLM2.variant() == "q4_1"
    assert SMOLLM2.directory(tmp_path).name.endswith("-q4_1")
