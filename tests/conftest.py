"""The whole suite: an optimised BLAS for MLX's CPU backend, loaded before any test imports mlx.

Tests live by kind, each kind with its own conftest (tests/README.md says what to run when):
tests/unit (in process), tests/server (server processes), tests/cluster (`mlx.launch` jobs),
tests/clients (SDKs, agent CLIs, a browser).
"""

from __future__ import annotations

from mlx_kvserve.blas import preload_optimised_blas

preload_optimised_blas()  # before any test module imports mlx: in-process tests run fast too
