"""`--draft-model` through real `serve` processes: a server drafting with a draft model gives the
answers of a server without speculation (the official OpenAI SDK, streamed and not), its
/metrics count `source="draft_model"`; a draft model of another vocabulary, or one server-wide
draft model beside two models, stops the start with exit 2 naming the cause.

The tiny model is its own draft: as large as its target, so drafting never pays and the
controller only probes (docs/speculation.md), which is what runs the draft model here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import ServerProcess, client_for
from tests.support.tiny_models import make_model_dir

PROMPT = "Tell me about the lighthouse keeper and the comet, in order."


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-server")
    # untied: its answers do not repeat their last token, so lookup leaves them to the draft
    target = make_model_dir(root / "target", "llama", seed=0, tie_word_embeddings=False)
    swapped = make_model_dir(root / "swapped", "llama", seed=1)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # two tokens trade ids
    a, b = sorted(vocab, key=vocab.__getitem__)[700:702]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {"root": root, "target": target, "swapped": swapped}


@pytest.fixture(scope="module")
def servers(dirs: dict[str, Path]) -> Iterator[dict[str, ServerProcess]]:
    model = ["--model", str(dirs["target"])]
    procs = {
        "off": ServerProcess(dirs["root"], *model, "--speculation", "off"),
        "draft": ServerProcess(
            dirs["root"], *model, "--speculation", "auto", "--draft-model", str(dirs["target"])
        ),
    }
    try:
        yield {mode: proc.wait_ready() for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def complete(server: ServerProcess, stream: bool) -> str:
    client = client_for(server)
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    body["extra_body"] = {"ignore_eos": True}
    if not stream:
        return client.completions.create(**body).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))


def test_a_server_with_a_draft_model_answers_as_one_without(servers) -> None:
    for stream in (False, True):
        assert complete(servers["draft"], stream) == complete(servers["off"], stream), stream
    text = httpx.get(servers["draft"].base_url + "/metrics").text
    pattern = r'^mlx_kvserve_speculation_drafted_tokens_total\{source="draft_model"\} (\S+)$'
    (drafted,) = re.findall(pattern, text, re.M)
    assert float(drafted) > 0  # the controller's probes ran the draft model
    assert "speculation drafts with a draft model too" in servers["draft"].log()
    assert "draft_model:" in servers["draft"].log()  # the request log line, by source


def serve(args: list[str], config: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "MLX_KVSERVE_CONFIG": str(config), **env},
    )  # fmt: skip


def test_a_draft_model_that_cannot_draft_stops_the_start(dirs, tmp_path: Path) -> None:
    target, swapped = str(dirs["target"]), str(dirs["swapped"])
    run = serve(
        ["--model", target, "--speculation", "auto", "--draft-model", swapped],
        tmp_path / "none.toml",
    )
    assert run.returncode == 2, run.stderr[-800:]
    assert "its tokenizer is not the model's" in run.stderr, run.stderr[-800:]
    both = serve(
        ["--model", f"a={target}", "--model", f"b={swapped}", "--speculation", "auto"],
        tmp_path / "none.toml",
        MLX_KVSERVE_DRAFT_MODEL=target,
    )
    assert both.returncode == 2 and "set it per model" in both.stderr, both.stderr[-800:]
    config = tmp_path / "config.toml"
    config.write_text(
        f'[[models]]\nname = "a"\nmodel = "{target}"\n'
        f'settings = {{ speculation = "auto", draft_model = "{swapped}" }}\n'
    )
    per_model = serve([], config)
    assert per_model.returncode == 2, per_model.stderr[-800:]
    assert "model a: the draft model" in per_model.stderr, per_model.stderr[-800:]
