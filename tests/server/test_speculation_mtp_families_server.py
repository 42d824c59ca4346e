"""MTP heads of the families added after Qwen and DeepSeek-V3 through the real server: tiny
GLM-5 (`glm_moe_dsa`: MLA with its sparse-attention indexer, a `CacheList` per layer) and
Nemotron-H (Mamba, attention and experts; an MTP module of two blocks) checkpoints carrying
heads that guess right only sometimes (tests/support/mtp_models.py), served with
`--speculation auto`, load their heads (the log says so) and answer as with `--speculation
off`, over the OpenAI SDK's completions and chat, streamed and not. Drafting is counted
in-process (tests/unit/test_speculation_mtp_families.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.test_speculation_mtp_server import answer
from tests.support.mtp_models import mtp_model_dir
from tests.support.servers import ServerProcess

DEPTH = {"glm_moe_dsa": 1, "nemotron_h": 2}  # Nemotron-H's module: an attention, an experts block


@pytest.fixture(scope="module", params=list(DEPTH))
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, ServerProcess]]]:
    family = request.param
    model = mtp_model_dir(
        tmp_path_factory.mktemp(family) / family, family=family, predictable=True, leak=0.05
    )
    procs = {
        mode: ServerProcess(model.parent, "--model", str(model), "--speculation", mode)
        for mode in ("off", "auto")
    }
    try:
        yield family, {mode: proc.wait_ready() for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def test_the_auto_server_loads_the_heads(servers):
    family, running = servers
    assert (
        f"drafting with the checkpoint's {DEPTH[family]} MTP layer(s) too" in running["auto"].log()
    )
    assert "MTP" not in running["off"].log()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_answers_are_the_same_with_mtp_drafting(servers, kind, stream):
    _, running = servers
    got = answer(running["auto"], kind, stream)
    assert got and got == answer(running["off"], kind, stream)
