"""Cluster tests: `serve` as the ranks of `mlx.launch` jobs on loopback (tests/support/launch.py),
and the single-process servers their answers must equal."""

from tests.support.cluster_jobs import job_models, llama_alone  # noqa: F401 (fixtures)
from tests.support.server_fixtures import (  # noqa: F401 (fixtures)
    agent_server,
    nocache_server,
    openai_client,
    server,
    session_dir,
    start_server,
)
