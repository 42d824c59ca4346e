"""Client tests: the real clients people point at the server (the official SDKs, the OpenAI
Agents SDK, the agent CLIs from npm, a browser) against real server processes."""

from tests.support.server_fixtures import (  # noqa: F401 (fixtures)
    agent_server,
    nocache_server,
    openai_client,
    server,
    session_dir,
    start_server,
)
