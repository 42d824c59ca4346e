"""Fetching a model while serving (Ollama's `/api/pull`): the repo's files one by one, each
checked against the digest the Hub lists for it, into the Hugging Face cache the server
already downloads `--model org/name` into at start (models/resolve.py: mlx-lm's `_download`,
whose `snapshot_download` and patterns `HuggingFaceHub` uses).

The Hub is reached through a named seam, `Hub`: `HuggingFaceHub` talks to the Hub;
`MirrorHub` reads `org/name` folders from a directory instead. `hub()` picks the mirror when
`MLX_KVSERVE_PULL_FROM` names one (the tests', which never reach the network; or a machine's
own copy of the repos), else the Hub.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MIRROR_ENV = "MLX_KVSERVE_PULL_FROM"


class PullError(Exception):
    """The repo cannot be fetched; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo: its path in the repo, size in bytes, and SHA-256 when the Hub
    lists one (its large files'), else None."""

    name: str
    size: int
    sha256: str | None


class Hub(Protocol):
    """Where models are fetched from."""

    def files(self, repo: str) -> list[RemoteFile]:
        """The repo's files a model needs (PullError: no such repo, or unreachable)."""
        ...

    def fetch(self, repo: str, name: str) -> Path:
        """One file, fetched (or already there); its local path."""
        ...

    def folder(self, repo: str) -> Path:
        """The model's local directory, once its files are fetched."""
        ...


def wanted(name: str) -> bool:
    """A file mlx-lm would download for a model (its own patterns)."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return any(fnmatch.fnmatch(name, pattern) for pattern in DEFAULT_ALLOW_PATTERNS)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class HuggingFaceHub:
    """The Hugging Face Hub, through huggingface_hub and mlx-lm's download."""

    def files(self, repo: str) -> list[RemoteFile]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        try:
            info = HfApi().model_info(repo, files_metadata=True)
        except RepositoryNotFoundError:
            raise PullError(404, f"no model {repo!r} on Hugging Face") from None
        except (HfHubHTTPError, OSError) as exc:
            raise PullError(502, f"cannot reach Hugging Face for {repo!r}: {exc}") from None
        return [
            RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None)
            for s in info.siblings or []
            if wanted(s.rfilename)
        ]

    # mlx-lm's `_download` with its patterns, minus its first step: a local directory of the
    # repo's name (relative to where the server runs) is never what a client pulls
    def fetch(self, repo: str, name: str) -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=[name])) / name

    def folder(self, repo: str) -> Path:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))


class MirrorHub:
    """Repos as `org/name` folders under `root`, copied into `dest/org/name` when fetched."""

    def __init__(self, root: Path, dest: Path) -> None:
        self.root = root
        self.dest = dest

    def _source(self, repo: str) -> Path:
        source = self.root / repo
        if ".." in Path(repo).parts or not source.is_dir():
            raise PullError(404, f"no model {repo!r} in {MIRROR_ENV}")
        return source

    def files(self, repo: str) -> list[RemoteFile]:
        source = self._source(repo)
        return [
            RemoteFile(
                p.name, p.stat().st_size, sha256_of(p) if p.suffix == ".safetensors" else None
            )
            for p in sorted(source.iterdir())
            if p.is_file() and wanted(p.name)
        ]

    def fetch(self, repo: str, name: str) -> Path:
        target = self.dest / repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._source(repo) / name, target)
        return target

    def folder(self, repo: str) -> Path:
        return self.dest / repo


def hub(data_dir: Path) -> Hub:
    """The mirror `MLX_KVSERVE_PULL_FROM` names (copied under `data_dir`), else the Hub."""
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        return MirrorHub(Path(mirror), data_dir / "pulled")
    return HuggingFaceHub()
