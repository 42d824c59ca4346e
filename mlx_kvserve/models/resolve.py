"""Turn the user's ``--model`` value into (model id for the API, what to pass to mlx_lm.load)."""

from __future__ import annotations

import re
from pathlib import Path

from .default_model import SMOLLM2
from .embedded import EmbeddedModel, ensure_model
from .gemma3_model import GEMMA3_270M

# Hugging Face repo ids: "org/name", each part letters, digits, '-', '_', '.'.
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
EMBEDDED: tuple[EmbeddedModel, ...] = (SMOLLM2, GEMMA3_270M)


def hub_repo(name: str) -> bool:
    """`name` has the form of a Hugging Face repo id, `org/name`."""
    return bool(_HF_REPO.fullmatch(name)) and ".." not in name


def embedded_model(name: str | None) -> EmbeddedModel | None:
    """The embedded model a ``--model`` value names (None -> the default), or None."""
    if name is None:
        return SMOLLM2
    wanted = name.strip().lower()
    return next((m for m in EMBEDDED if wanted in m.names), None)


def resolve_model(spec: str | None, data_dir: Path, *, progress: bool) -> tuple[str, str]:
    """Return ``(model_id, path_or_repo)`` for ``spec``.

    None / ``"default"`` (or the default's id) -> the embedded default model, and an embedded
    model's name (``gemma3-270m``) -> that model, each converted on first use; an existing
    directory with ``config.json`` -> that directory (id = its folder name);
    an ``org/name`` string that is not a local path -> a Hugging Face repo id, passed through
    unchanged (downloading is mlx_lm's business). Anything else raises ValueError.
    """
    embedded = embedded_model(spec)
    if embedded is not None:
        return embedded.model_id, str(ensure_model(embedded, Path(data_dir), progress=progress))

    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {spec!r} has no config.json (expected an mlx-lm / Hugging Face "
                "model folder)"
            )
        path = path.resolve()
        return path.name, str(path)
    if path.exists():
        raise ValueError(f"model {spec!r} is a file; pass the model's directory instead")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") != 1
    if not looks_like_path and hub_repo(spec):
        return spec, spec
    raise ValueError(
        f"model {spec!r} is neither an existing model directory nor a Hugging Face repo id "
        "of the form 'org/name' (or an embedded model: 'default' for SmolLM2-135M-Instruct, "
        "'gemma3-270m' for Gemma 3 270M)"
    )


def local_model_dir(model_ref: str) -> Path:
    """The local directory for a ``resolve_model`` result, downloading a hub repo if needed.

    Imports mlx_lm (and so MLX) only for a hub repo id: call after the BLAS preload.
    """
    path = Path(model_ref).expanduser()
    if path.is_dir():
        return path
    from mlx_lm.utils import _download  # the same fetch (and cache) mlx_lm.load would use

    return Path(_download(model_ref))
