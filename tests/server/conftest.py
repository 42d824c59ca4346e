"""Server tests: each file starts real `mlx-kvserve serve` processes (shared per file where it
can) and talks HTTP to them."""

from tests.support.model_fixtures import client, tokenizer  # noqa: F401 (fixtures)
from tests.support.server_fixtures import (  # noqa: F401 (fixtures)
    agent_server,
    nocache_server,
    openai_client,
    server,
    session_dir,
    start_server,
)
