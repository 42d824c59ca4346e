"""Per-user directories, created private (0700) because they hold prompts and keys."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "mlx-kvserve"


def _private_dir(path: Path) -> Path:
    """Create `path` private (0700); an existing directory is left as it is, since it may be
    one the user shares (`MLX_KVSERVE_CACHE_DIR=/tmp` must not lock other users out of /tmp)."""
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        return path
    os.chmod(path, 0o700)
    return path


def data_dir() -> Path:
    """Converted models and downloads; MLX_KVSERVE_DATA_DIR overrides the platform default."""
    override = os.environ.get("MLX_KVSERVE_DATA_DIR")
    return _private_dir(Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME)))


def cache_dir(*, create: bool = True) -> Path:
    """Prompt-cache checkpoints; MLX_KVSERVE_CACHE_DIR overrides the platform default."""
    override = os.environ.get("MLX_KVSERVE_CACHE_DIR")
    path = Path(override) if override else Path(platformdirs.user_cache_dir(APP_NAME))
    return _private_dir(path) if create else path


def config_file() -> Path:
    """Optional TOML config; MLX_KVSERVE_CONFIG overrides the platform default location."""
    override = os.environ.get("MLX_KVSERVE_CONFIG")
    if override:
        return Path(override)
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def ensure_private(path: Path) -> Path:
    """Create `path` as a private directory (0700) if missing, and return it."""
    return _private_dir(path)
