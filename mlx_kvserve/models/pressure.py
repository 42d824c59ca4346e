"""The system's memory pressure, read as "normal", "warn" or "critical".

One seam, `PressureSource.read()`, with three real readers; `pressure_source()` picks one:

* **A file** named by `MLX_KVSERVE_PRESSURE_FILE` holding one of the three words: how a test,
  or an operator's own monitor, tells the server what the system will not (the server reads it
  exactly as it reads the kernel; nothing else in the server is replaced).
* **macOS**: `sysctl kern.memorystatus_vm_pressure_level` (1 normal, 2 warn, 4 critical), the
  level the kernel's memory-status machinery acts on before it starts swapping and jetsamming.
* **Linux**: PSI, `/proc/pressure/memory`. `some avg10` is the share of the last 10 s in which
  at least one task waited for memory (reclaim, refaults, swap-in); `full avg10` the share in
  which every runnable task did. A healthy system reads 0.00 with small blips of page-cache
  reclaim, so warn starts at `some` >= 10 % (reclaim is now costing real time: the point to
  give memory back, before swapping grows), and critical at `full` >= 10 % or `some` >= 40 %
  (the system is thrashing: whole seconds go to waiting for memory).

Whatever cannot be read or parsed reads as normal: pressure handling only ever gives memory
back, so a reader that fails must not make the server shed models.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from mlx_kvserve import macos

log = logging.getLogger("mlx_kvserve.models")

NORMAL, WARN, CRITICAL = "normal", "warn", "critical"
LEVELS = (NORMAL, WARN, CRITICAL)
GAUGE = {NORMAL: 0, WARN: 1, CRITICAL: 2}  # the value of mlx_kvserve_memory_pressure

FILE_ENV = "MLX_KVSERVE_PRESSURE_FILE"
PSI_PATH = Path("/proc/pressure/memory")
SYSCTL_NAME = "kern.memorystatus_vm_pressure_level"

PSI_WARN_SOME = 10.0
PSI_CRITICAL_SOME = 40.0
PSI_CRITICAL_FULL = 10.0
MACOS_LEVELS = {1: NORMAL, 2: WARN, 4: CRITICAL}


class PressureSource(Protocol):
    """Where the level comes from; `read` is cheap (polled every second) and never raises."""

    name: str

    def read(self) -> str: ...


# -- parsers (pure: any text in, a level out) -----------------------------------------------
def parse_psi(text: str) -> str:
    """The level of a `/proc/pressure/memory` text (`some avg10=1.23 avg60=... total=...`)."""
    some = _psi_avg10(text, "some")
    full = _psi_avg10(text, "full")
    if full >= PSI_CRITICAL_FULL or some >= PSI_CRITICAL_SOME:
        return CRITICAL
    if some >= PSI_WARN_SOME:
        return WARN
    return NORMAL


def _psi_avg10(text: str, kind: str) -> float:
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] != kind:
            continue
        for field in fields[1:]:
            key, _, value = field.partition("=")
            if key == "avg10":
                try:
                    number = float(value)
                except ValueError:
                    return 0.0
                return number if 0.0 <= number <= 100.0 else 0.0  # nan, inf: not a reading
    return 0.0


def parse_sysctl(text: str) -> str:
    """The level of `sysctl kern.memorystatus_vm_pressure_level` output (`2`, or with the
    name: `kern.memorystatus_vm_pressure_level: 2`)."""
    value = text.strip().rpartition(":")[2].strip()
    try:
        return macos_level(int(value))
    except ValueError:
        return NORMAL


def macos_level(value: int) -> str:
    return MACOS_LEVELS.get(value, NORMAL)


def parse_word(text: str) -> str:
    """A pressure file's content: normal, warn or critical (anything else is normal)."""
    word = text.strip().lower()
    return word if word in LEVELS else NORMAL


# -- readers --------------------------------------------------------------------------------
class FileSource:
    """A file holding normal, warn or critical (a missing or unreadable file: normal)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = f"the file {path}"

    def read(self) -> str:
        try:
            return parse_word(self.path.read_text(errors="replace")[:64])
        except OSError:
            return NORMAL


class PsiSource:
    """Linux pressure-stall information for memory."""

    def __init__(self, path: Path = PSI_PATH) -> None:
        self.path = path
        self.name = f"PSI ({path})"

    def read(self) -> str:
        try:
            return parse_psi(self.path.read_text(errors="replace"))
        except OSError:
            return NORMAL


class SysctlSource:
    """macOS's memorystatus level, read with sysctlbyname (no process per poll)."""

    name = f"sysctl {SYSCTL_NAME}"

    def read(self) -> str:
        value = macos.sysctl_int(SYSCTL_NAME)
        return NORMAL if value is None else macos_level(value)


def pressure_source(environ: dict[str, str] | None = None) -> PressureSource | None:
    """The source this system offers: the file named by MLX_KVSERVE_PRESSURE_FILE, else the
    kernel's (sysctl on macOS, PSI on Linux); None where neither can be read."""
    environ = os.environ if environ is None else environ
    if environ.get(FILE_ENV):
        return FileSource(Path(environ[FILE_ENV]))
    try:
        if macos.on_macos():
            return SysctlSource()
        if PSI_PATH.exists():
            PSI_PATH.read_text()
            return PsiSource(PSI_PATH)
    except OSError as exc:
        log.info("memory pressure cannot be read here (%s): not watched", exc)
        return None
    log.info("this system reports no memory pressure (no PSI): not watched")
    return None
