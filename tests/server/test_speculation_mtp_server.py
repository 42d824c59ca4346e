"""MTP heads through the real server: a tiny Qwen3.5 checkpoint carrying `mtp.*` tensors
(tests/support/mtp_models.py, heads that guess right only sometimes) served with
`--speculation auto` loads its heads (the log says so) and answers as with `off` and with
`--mtp off` (no heads loaded), over the OpenAI SDK's completions, chat and JSON-schema chat (a
grammar), streamed and not, and for a long prompt prefilled in many chunks (each feeding the
MTP source) and its next turn served from the prompt cache, also after a restart (the entry's
MTP part read from disk); `/metrics` has the `source="mtp"` series. `--mtp on` refuses at
start a checkpoint without heads, naming why.
How much it drafts depends on the verify cost the server measures on this shared machine, so
drafting is counted in-process (tests/unit/test_speculation_mtp.py), not here."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.kill_loop import wait_for_writes
from tests.support.mtp_models import mtp_model_dir
from tests.support.servers import ServerProcess, client_for
from tests.support.tiny_models import make_model_dir

LOADED = "drafting with the checkpoint's 1 MTP layer(s) too"
SCHEMA = {
    "type": "object",
    "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
    "required": ["numbers"],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtp_model_dir(tmp_path_factory.mktemp("mtp") / "qwen35-mtp", predictable=True, leak=0.05)


@pytest.fixture(scope="module")
def servers(model: Path) -> Iterator[dict[str, ServerProcess]]:
    flags = {"off": ["--speculation", "off"], "auto": ["--speculation", "auto"]}
    flags["mtp_off"] = ["--speculation", "auto", "--mtp", "off"]
    procs = {  # chunks of 16: a long prompt's prefill feeds the MTP chunk by chunk
        mode: ServerProcess(model.parent, "--model", str(model), "--prefill-step", "16", *args)
        for mode, args in flags.items()
    }
    try:
        yield {mode: proc.wait_ready() for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def answer(server: ServerProcess, kind: str, stream: bool) -> str:
    client = client_for(server)
    body = {"model": "default", "max_tokens": 48, "temperature": 0}
    if kind == "text":
        body["prompt"] = "The numbers go one, two, three,"
        if stream:
            return "".join(
                c.choices[0].text for c in client.completions.create(**body, stream=True)
            )
        return client.completions.create(**body).choices[0].text
    body["messages"] = [{"role": "user", "content": "Count from one to ten."}]
    if kind == "json":  # a grammar row: MTP drafts walked through its matcher
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "count", "schema": SCHEMA},
        }
    if stream:
        chunks = client.chat.completions.create(**body, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(**body).choices[0].message.content or ""


def test_the_auto_server_loads_the_heads_and_the_off_servers_do_not(servers):
    assert LOADED in servers["auto"].log()
    assert "MTP" not in servers["off"].log()
    assert "MTP" not in servers["mtp_off"].log()
    metrics = httpx.get(servers["auto"].base_url + "/metrics").text
    assert 'mlx_kvserve_speculation_drafted_tokens_total{source="mtp"}' in metrics


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["text", "chat", "json"])
def test_answers_are_the_same_with_mtp_drafting(servers, kind, stream):
    got = answer(servers["auto"], kind, stream)
    assert got and got == answer(servers["off"], kind, stream)
    assert got == answer(servers["mtp_off"], kind, stream)


@pytest.mark.parametrize(
    ("flags", "cause"),
    [
        (["--speculation", "auto"], "its config.json states no MTP layers"),
        (["--speculation", "off"], "speculation is off"),
    ],
    ids=["no_heads", "speculation_off"],
)
def test_mtp_on_refuses_at_start_what_cannot_draft(tmp_path, flags, cause):
    """`--mtp on` asks for the heads: a checkpoint without them (or no speculation to draft
    for) is refused before the server listens, naming the cause."""
    model = make_model_dir(tmp_path / "plain", "qwen3_5")
    proc = ServerProcess(tmp_path, "--model", str(model), "--mtp", "on", *flags)
    try:
        code = proc.proc.wait(timeout=120)
    finally:
        proc.stop()
    assert code != 0
    assert "--mtp on: cannot draft for" in proc.log() and cause in proc.log()
    assert "Traceback" not in proc.log()


def test_a_long_prompt_and_its_next_turn_answer_as_without_mtp(servers):
    """A prompt of many prefill chunks (every chunk's hidden states fed to the row's MTP
    source), then the next turn on top of it (the prompt cache serves the first): greedy
    answers are the same with MTP drafting, streamed and not."""
    prompt = " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(40))

    def turns(server: ServerProcess, stream: bool) -> list[str]:
        client = client_for(server)
        out, text = [], prompt
        for _ in range(2):
            body = {"model": "default", "max_tokens": 32, "temperature": 0, "prompt": text}
            if stream:
                chunks = client.completions.create(**body, stream=True)
                out.append("".join(c.choices[0].text for c in chunks))
            else:
                out.append(client.completions.create(**body).choices[0].text)
            text += out[-1] + " and then item 41 costs"
        return out

    for stream in (False, True):
        got = turns(servers["auto"], stream)
        assert all(got) and got == turns(servers["off"], stream)
        assert got == turns(servers["mtp_off"], stream)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_turn_restored_from_disk_after_a_restart_answers_as_without_speculation(
    servers, model, tmp_path, sig
):
    """The prompt cache keeps the MTP layers' state beside the target's (cache/mtp_part.py):
    a conversation's first turn, the server stopped (or killed once its writes landed: its
    entries then suspect until their probe is checked) and started again on the same cache
    directory, and its second turn, whose prefix (and MTP state) the disk serves: greedy
    answers equal the `--speculation off` server's, streamed and not."""
    prompt = " ".join(f"box {i} holds {i * 5 % 11} marbles;" for i in range(30))
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--model", str(model), "--prefill-step", "16"]

    def turn(server: ServerProcess, text: str, stream: bool) -> str:
        client = client_for(server)
        body = {"model": "default", "max_tokens": 24, "temperature": 0, "prompt": text}
        if stream:
            chunks = client.completions.create(**body, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(**body).choices[0].text

    for stream in (False, True):
        first = ServerProcess(tmp_path, *args, "--speculation", "auto", env=env).wait_ready()
        try:
            one = turn(first, prompt, stream)
            wait_for_writes(first)
        finally:
            first.stop(sig)
        text = prompt + one + " and box 31 holds"
        second = ServerProcess(tmp_path, *args, "--speculation", "auto", env=env).wait_ready()
        try:
            two = turn(second, text, stream)
            log = second.log()
        finally:
            second.stop()
        assert "cache=disk" in log
        assert ("did not shut down cleanly" in log) == (sig == signal.SIGKILL)
        assert one and one == turn(servers["off"], prompt, stream)
        assert two and two == turn(servers["off"], text, stream)
