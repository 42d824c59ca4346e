"""Load an optimised BLAS into the process before MLX, so MLX's Linux CPU backend uses it.

The ``mlx-cpu`` wheel links a reference BLAS (about 6 GFLOP/s for a float32 matmul on a small
machine). MLX resolves ``cblas_sgemm`` through the process's global symbol scope, so a library
loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported wins. We use the OpenBLAS shipped by
the ``ngsolve-openblas`` wheel (standard ``cblas_*`` symbols, RPATH ``$ORIGIN``). It needs
``libgfortran.so.5``, which a fresh machine may lack, but the ``mlx-cpu`` wheel bundles one (under a
hashed name, with its ``libquadmath``). We copy the three files into a private folder under the
data dir, with the names the loader looks for, and load OpenBLAS from there.

Everything here is best-effort: any failure logs one warning and the server runs (slowly) on the
reference BLAS.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .paths import data_dir, ensure_private

log = logging.getLogger(__name__)

ENV_SWITCH = "MLX_KVSERVE_BLAS"
_OPENBLAS_DIST = "ngsolve-openblas"
_OPENBLAS_PKG = "ngsolve_openblas"
_MLX_CPU_DIST = "mlx-cpu"

_loaded: str | None = None


def _cpu_count() -> int:
    """Cores this process may run on (respects affinity / cpusets, unlike os.cpu_count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _find_openblas() -> tuple[Path, str]:
    """The OpenBLAS shared library and its package version, without importing the package.

    Importing ``ngsolve_openblas`` would itself try to dlopen the library (and fail without a
    system libgfortran), so we only look at its spec and distribution metadata.
    """
    spec = importlib.util.find_spec(_OPENBLAS_PKG)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {_OPENBLAS_DIST!r} is not installed")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    libs = sorted(pkg_dir.glob("libopenblas*.so*"))
    if not libs:
        raise RuntimeError(f"no libopenblas*.so in {_OPENBLAS_DIST}")
    try:
        version = importlib.metadata.version(_OPENBLAS_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return libs[0], version


def _find_mlx_runtime_libs() -> tuple[Path, Path]:
    """The libgfortran and libquadmath that the ``mlx-cpu`` wheel bundles (hashed names)."""
    dist = importlib.metadata.distribution(_MLX_CPU_DIST)
    gfortran = quadmath = None
    for f in dist.files or ():
        name = f.name
        if re.match(r"libgfortran.*\.so\.5", name):
            gfortran = Path(str(dist.locate_file(f)))
        elif re.match(r"libquadmath.*\.so", name):
            quadmath = Path(str(dist.locate_file(f)))
    if gfortran is None or quadmath is None:
        raise RuntimeError(f"{_MLX_CPU_DIST} does not ship libgfortran/libquadmath")
    return gfortran, quadmath


def _copy_if_needed(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` atomically unless an identical-size copy is already there.

    Copies, not symlinks: the loader resolves ``$ORIGIN`` of a symlink to the link's folder, but
    a copy also survives the venv being upgraded underneath a running server.
    """
    size = src.stat().st_size
    try:
        if dst.stat().st_size == size:
            return
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prepare(folder_root: Path) -> tuple[Path, str]:
    """Populate the private BLAS folder; return the OpenBLAS copy to load and its version."""
    openblas, version = _find_openblas()
    gfortran, quadmath = _find_mlx_runtime_libs()
    folder = ensure_private(folder_root / "blas") / re.sub(r"[^A-Za-z0-9._-]", "_", version)
    ensure_private(folder)
    # libgfortran first: OpenBLAS's NEEDED entry is the plain soname `libgfortran.so.5`, found
    # next to it through its RPATH; libgfortran in turn finds libquadmath by its hashed name.
    _copy_if_needed(quadmath, folder / quadmath.name)
    _copy_if_needed(gfortran, folder / "libgfortran.so.5")
    target = folder / openblas.name
    _copy_if_needed(openblas, target)
    return target, version


def preload_optimised_blas(threads: int = 0) -> str | None:
    """Load OpenBLAS globally so that a later ``import mlx.core`` uses it for matmuls.

    `threads` > 0 sets its thread count; 0 keeps ``OPENBLAS_NUM_THREADS`` if the environment
    has it, else half the cores. Returns a short description of what was loaded, or None if
    nothing was (non-Linux, disabled with ``MLX_KVSERVE_BLAS=off``, MLX already imported, or any
    failure). Never raises.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get(ENV_SWITCH, "").strip().lower() in {"off", "0", "false", "no"}:
        log.info("optimised BLAS disabled by %s", ENV_SWITCH)
        return None
    if "mlx.core" in sys.modules:
        log.warning(
            "prefill will be slow: mlx was imported before the optimised BLAS could be loaded "
            "(call preload_optimised_blas() first)"
        )
        return None
    try:
        # OpenBLAS reads its thread count once, when it is loaded. Half the cores: its worker
        # threads spin while they wait, and with every core taken, any other busy process (a
        # second server, a client, a test run) slowed prefill 5-7x on a 2-core machine, while
        # one thread there is within 5% of two when the machine is otherwise idle.
        if threads > 0:
            os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        count = os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, _cpu_count() // 2)))
        target, version = _prepare(data_dir())
        lib = ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)
        lib.cblas_sgemm  # noqa: B018 - fail here, not inside MLX, if the symbol is missing
        core = ""
        try:
            lib.openblas_get_corename.restype = ctypes.c_char_p
            core = (lib.openblas_get_corename() or b"").decode(errors="replace").strip()
        except AttributeError:
            pass
        desc = f"OpenBLAS {version} ({core + ', ' if core else ''}{count} threads)"
    except Exception as exc:  # noqa: BLE001 - best effort by design
        log.warning("prefill will be slow: could not load an optimised BLAS (%s)", exc)
        return None
    _loaded = desc
    log.info("loaded %s for MLX's CPU backend", desc)
    return desc
