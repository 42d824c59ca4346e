"""Every cache type mlx-lm builds, served end to end: tiny random-weight models of mlx-lm's own
architectures (tests/support/tiny_models.py) behind real servers.

Per architecture: the server starts and describes its layers; greedy answers with the prompt
cache equal a `--no-cache` server's over a four-turn conversation, with a restart of the cached
server in the middle whose next turn is served from disk. A prefill chunk of 16 tokens and a
checkpoint every 64 make every turn prefill in several chunks and checkpoint inside them; the
windows of the tiny models (32) are slid past by every prompt.

The matrix: llama (plain KVCache, deltas, batched), qwen3_5 (linear attention: ArraysCache +
KVCache, wrapped in text_config), gemma3_text (RotatingKVCache windows), gpt_oss (windows, sinks,
experts, no context field mlx-lm reads), deepseek_v3 (MLA latent KV), mamba2 (SSM state only),
falcon_h1 (CacheList of SSM state and KV), llama4 (ChunkedKVCache).

Per architecture the `--no-cache` reference runs for all its tests, the restart test's first
cache-on server starts beside it, and the one the restart test leaves running serves the
concurrent conversations next (fewer starts, started at once); the references are asked while
the cache-on server works on the same requests.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.concurrently import concurrently
from tests.support.servers import ServerProcess, client_for
from tests.support.tiny_models import make_model_dir

pytestmark = pytest.mark.slow

# What the start-up log says of each model's layers, and the context window its config states.
MATRIX = {
    "llama": ("2 tokens", 8192),
    "qwen3_5": ("3 state + 1 tokens", 32768),
    "gemma3_text": ("2 window of 32 + 1 tokens", 32768),
    "gpt_oss": ("1 window of 32 + 1 tokens", 131072),
    "deepseek_v3": ("2 tokens", 16384),
    "mamba2": ("2 state", 8192),
    "falcon_h1": ("2 list (tokens)", 8192),
    "llama4": ("3 window of 32 + 1 tokens", 16384),
}
FLAGS = ("--prefill-step", "16", "--checkpoint-interval", "64")
SYSTEM = {
    "role": "system",
    "content": "You are the help desk of a small bicycle shop in a river town. Answer briefly. "
    "We repair city bikes, road bikes and cargo bikes, sell tyres, lights, locks and bells, "
    "rent tandems on weekends, and are closed on Mondays and public holidays.",
}
QUESTIONS = [
    "Can you fix a flat tyre today?",
    "How much is a tandem for a Saturday?",
    "Do you sell front lights that charge over USB?",
    "Are you open on Easter Monday?",
]


@dataclass
class Arch:
    name: str
    model_dir: Path
    work: Path
    reference: ServerProcess  # --no-cache
    running: list[ServerProcess] = field(default_factory=list)  # cache-on, on work/kv
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))

    def ask(self, messages: list[dict], max_tokens: int = 12) -> Future:
        """The reference's (answer, usage) for `messages`, asked now: requests to it run one at
        a time (solo answers), while the cache-on server works."""
        return self._pool.submit(chat, self.reference, messages, max_tokens)


@pytest.fixture(scope="module", params=list(MATRIX))
def arch(request, tmp_path_factory) -> Iterator[Arch]:
    work = tmp_path_factory.mktemp(request.param)
    model_dir = make_model_dir(work / "model", request.param)
    reference = ServerProcess(work, "--model", str(model_dir), "--no-cache", *FLAGS)
    arch = Arch(request.param, model_dir, work, reference)
    try:
        spawn_cached_server(arch)  # (starting beside the reference) for the restart test
        reference.wait_ready()
        yield arch
    finally:
        arch._pool.shutdown()
        for server in [reference, *arch.running]:
            server.stop()


def chat(server: ServerProcess, messages: list[dict], max_tokens: int = 12):
    resp = client_for(server).chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=max_tokens
    )
    return resp.choices[0].message.content, resp.usage


def spawn_cached_server(arch: Arch) -> ServerProcess:
    """Start a new cache-on server on the architecture's cache directory (the one running there
    is stopped first), left running for the next test; the module's end stops it."""
    for server in arch.running:
        assert server.stop() == 0
    env = {"MLX_KVSERVE_CACHE_DIR": str(arch.work / "kv")}
    server = ServerProcess(arch.work, "--model", str(arch.model_dir), *FLAGS, env=env)
    arch.running[:] = [server]
    return server


def cached_server(arch: Arch) -> ServerProcess:
    """The cache-on server running on the architecture's cache directory (the first test to
    ask gets the one the fixture started, on an empty cache), else a new one; ready."""
    alive = [s for s in arch.running if s.proc.poll() is None]
    return (alive[0] if alive else spawn_cached_server(arch)).wait_ready()


def test_starts_and_describes_its_layers(arch: Arch):
    layers, context = MATRIX[arch.name]
    ready = arch.reference.wait_for_log("model ready")
    line = next(x for x in ready.splitlines() if "model ready" in x)
    assert f"layers: {layers};" in line
    assert f"context {context} tokens" in line
    assert httpx.get(arch.reference.base_url + "/health").json()["status"] == "ok"


def test_cache_answers_like_no_cache_across_a_restart(arch: Arch):
    server = cached_server(arch)
    messages, usages, answers = [SYSTEM], [], []
    for turn, question in enumerate(QUESTIONS):
        messages = [*messages, {"role": "user", "content": question}]
        reference = arch.ask(messages)
        if turn == 2:  # restart: the next turn must come from the disk tier
            server = spawn_cached_server(arch).wait_ready()
        answer, usage = chat(server, messages)
        expected, ref_usage = reference.result()
        assert answer == expected, f"turn {turn}"
        assert usage.prompt_tokens == ref_usage.prompt_tokens
        assert ref_usage.prompt_tokens_details.cached_tokens == 0
        usages.append(usage)
        answers.append(answer)
        messages = [*messages, {"role": "assistant", "content": answer}]
        if turn == 2:
            stats = httpx.get(server.base_url + "/v1/cache").json()
            assert stats["restores_from_disk"] >= 1
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == 0
    # Every later turn reuses at least the whole previous prompt: a delta is cut back to
    # it, a snapshot (recurrent state, full window) is the "prompt" checkpoint taken one
    # token before its end (so that a retry of it is served too; engine/generate.py),
    # chained to the turns before it. Unless the answer began with white space: then the
    # newline that ends the generation prompt re-tokenizes merged with it, the previous
    # prompt is no token prefix of the next, and a snapshot serves only the checkpoint
    # before it (an interval or a message boundary).
    prompts = [u.prompt_tokens for u in usages]
    slack = 0 if re.fullmatch(r"\d+ tokens", MATRIX[arch.name][0]) else 1
    for k in range(1, len(usages)):
        if answers[k - 1][:1].isspace():
            assert cached[k] > 0, (prompts, cached, answers)
        else:
            assert cached[k] >= prompts[k - 1] - slack, (prompts, cached, answers)
    # A retry of the last request (a client that timed out, a regenerate) prefills only
    # its last token: trimmable layers are cut back from the answer's checkpoint, the
    # others restore the "prompt" snapshot taken one token before the prompt's end.
    answer, usage = chat(server, messages[:-1])
    assert answer == answers[-1]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    log = server.log()
    assert "Traceback" not in log
    assert re.search(r"cache=disk", log)


def test_concurrent_conversations_batch_and_answer_like_no_cache(arch: Arch):
    """Three conversations at once decode together (all but llama4's chunked attention), and
    their next turns, served from the checkpoints the batch left, still answer like no cache.
    (The server may hold the restart test's checkpoints: the first conversation's first turn
    is then served from them.)"""
    server = cached_server(arch)
    before = len(re.findall(r" batch=(\d+) ", server.log()))
    convs = [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS[:3]]
    for turn in range(2):
        references = [arch.ask(m, max_tokens=40) for m in convs]
        got = concurrently(lambda m: chat(server, m, max_tokens=40), convs, len(convs))
        for (answer, usage), reference in zip(got, references, strict=True):
            assert answer == reference.result()[0]
            if turn:  # (the first turns may share the system prompt's anchor)
                assert usage.prompt_tokens_details.cached_tokens > 0
        convs = [
            [*m, {"role": "assistant", "content": a}, {"role": "user", "content": "Thanks!"}]
            for m, (a, _) in zip(convs, got, strict=True)
        ]
    peaks = [int(n) for n in re.findall(r" batch=(\d+) ", server.log())[before:]]
    assert len(peaks) == 6
    assert max(peaks) == 1 if arch.name == "llama4" else max(peaks) >= 2
    assert "Traceback" not in server.log()


def test_an_architecture_mlx_lm_cannot_load_is_refused_at_start(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", "llama")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    proc = ServerProcess(tmp_path, "--model", str(model_dir))
    assert proc.proc.wait(120) == 2
    log = proc.log()
    proc.stop()
    assert "cannot load model_type 'no_such_arch'" in log
    assert "Traceback" not in log


def test_a_config_without_a_context_length_is_said_at_start(tmp_path):
    """No window stated anywhere: the server starts, says so, and still answers."""
    # omitted, and no rope scaling to derive one from (models/context.py)
    model_dir = make_model_dir(
        tmp_path / "model", "llama", max_position_embeddings=None, rope_scaling=None
    )
    server = ServerProcess(tmp_path, "--model", str(model_dir)).wait_ready()
    try:
        assert "states no context length" in server.log()
        assert "context None tokens" in server.log()
        resp = client_for(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], temperature=0
        )
        assert resp.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_a_cache_that_cannot_be_restored_turns_the_prompt_cache_off(tmp_path):
    """DeepSeek-V4.1's layer cache has a read-only `state`: a checkpoint of it could never be
    restored, so the server says so at start-up, writes none, and answers like `--no-cache`
    (rather than write every turn and fail every restore); the session resident in memory
    still serves the next turn."""
    model_dir = make_model_dir(tmp_path / "model", "deepseek_v41")
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")}
    server = ServerProcess(tmp_path, "--model", str(model_dir), *FLAGS, env=env)
    reference = ServerProcess(tmp_path, "--model", str(model_dir), "--no-cache")
    try:
        server.wait_ready()  # (the two start at once)
        reference.wait_ready()
        assert "prompt cache off for this model: cache class(es) LayerCache" in server.log()
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        for turn in range(2):
            answer, usage = chat(server, messages)
            assert answer == chat(reference, messages)[0]
            # the second turn may reuse the resident session in memory, never a checkpoint
            assert usage.prompt_tokens_details.cached_tokens == 0 or turn == 1
            messages = [*messages, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": QUESTIONS[turn + 1]})
        assert " cache=disk" not in server.log() and " cache=ram" not in server.log()
        stats = httpx.get(server.base_url + "/v1/cache").json()
        assert stats["files_written"] == 0 and stats["restore_errors"] == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()
        reference.stop()


def test_a_cache_of_another_architecture_is_a_clean_miss(tmp_path):
    """Two architectures on one cache directory: each sees only its own checkpoints."""
    env = {"MLX_KVSERVE_CACHE_DIR": str(tmp_path / "kv")}
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    for name in ("llama", "qwen3_5"):
        model_dir = make_model_dir(tmp_path / name, name)
        server = ServerProcess(tmp_path, "--model", str(model_dir), env=env).wait_ready()
        try:
            _, usage = chat(server, messages)
            assert usage.prompt_tokens_details.cached_tokens == 0
            stats = httpx.get(server.base_url + "/v1/cache").json()
            assert stats["restore_errors"] == 0
        finally:
            assert server.stop() == 0
        assert "Traceback" not in server.log()


LONG_QUESTION = (
    "Here is my whole repair history, please read it before you answer. "
    + " ".join(f"Visit {i}: new chain, brake pads, the rear wheel trued." for i in range(14))
    + " What should I replace next?"
)
KILL_LINE = "injected fault at disk_write_kill: SIGKILL"


def test_a_sigkill_mid_prefill_loses_nothing(arch: Arch):
    """The server kills itself halfway through writing its second checkpoint file, while it is
    still prefilling a long prompt (a checkpoint every 64 tokens; for a model whose checkpoints
    supersede each other, a busy writer skips the ones a newer one made redundant, so only the
    second write is sure to come). The restarted server serves the entry that was complete,
    answers like `--no-cache`, and finds no damaged entry."""
    kv = arch.work / "kv-kill"
    env = {"MLX_KVSERVE_CACHE_DIR": str(kv), "MLX_KVSERVE_FAULTS": "disk_write_kill@2"}
    messages = [SYSTEM, {"role": "user", "content": LONG_QUESTION}]
    reference = arch.ask(messages)
    dying = ServerProcess(arch.work, "--model", str(arch.model_dir), *FLAGS, env=env).wait_ready()
    # The connection dies with the server, mid-request; on a loaded machine the writer can lag
    # behind the prefill, and the second write (and the kill) come just after the answer.
    with contextlib.suppress(Exception):
        chat(dying, messages)
    assert dying.proc.wait(60) == -9
    assert KILL_LINE in dying.log()
    dying.stop()
    server = ServerProcess(
        arch.work, "--model", str(arch.model_dir), *FLAGS, env={"MLX_KVSERVE_CACHE_DIR": str(kv)}
    ).wait_ready()
    try:
        answer, usage = chat(server, messages)
        expected, ref_usage = reference.result()
        assert answer == expected
        # The file written before the kill holds the start of this very prompt.
        assert 0 < usage.prompt_tokens_details.cached_tokens < ref_usage.prompt_tokens
        stats = httpx.get(server.base_url + "/v1/cache").json()
        assert stats["unclean_start"] is True
        assert stats["restore_errors"] == 0 and stats["failure_evictions"] == 0
        log = server.log()
        assert "dropped damaged file" not in log and "Traceback" not in log
    finally:
        server.stop()
