"""Crash safety against real server processes (issue 4, DESIGN invariants 5-6).

Every answer is a greedy completion compared with the answer of a `--no-cache` server to the same
request, so no kill, damaged file or injected fault can buy anything with wrong output. What is
tested is the cache, not the model: every server here runs a tiny random-weight llama with the
default model's architecture and tokenizer (plain trimmable KV, 512 bytes per token instead of
46,080), which starts and answers several times faster than the default model. The
kill-and-restart loop (`KillLoop`, tests/support/kill_loop.py) is shared with `scripts/soak.py`,
which runs it for longer and on hybrid and sliding-window models with padded vocabularies.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlx_kvserve.cache import PromptCache, codec
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.entry import entry_key
from tests.support.cache_testing import poison_entry
from tests.support.concurrently import concurrently
from tests.support.kill_loop import (
    KillLoop,
    MiB,
    cache_env,
    cache_stats,
    entry_files,
    fingerprint_dir,
    is_failure_eviction,
    log_lines,
    temp_files,
    wait_for_writes,
)
from tests.support.servers import ServerProcess
from tests.support.soak_workload import (
    MAX_TOKENS,
    MODEL,
    TIMEOUT,
    Target,
    Turn,
    answer,
    build_workload,
    chat,
)
from tests.support.tiny_models import make_model_dir


# ====================================================================== entry-file surgery ===
def read_entry(path: Path) -> tuple[dict, codec.Slot | None, list[HostArray]]:
    raw = path.read_bytes()
    header_len, digest, slot = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    arrays = codec.decode_payload(memoryview(raw)[codec.payload_start(header_len) :], header)
    return header, slot, [HostArray(a.name, a.dtype, a.shape, np.array(a.data)) for a in arrays]


def write_entry(path: Path, header: dict, slot: codec.Slot | None, arrays: list[HostArray]):
    """Write an entry whose checksums all match its (possibly lying) header and payload."""
    specs, size = codec.array_specs(arrays)
    header = dict(header, arrays=specs, payload_bytes=size)
    header["payload_sha256"] = codec.payload_digest(arrays)
    head = codec.pack_head(header, slot or codec.Slot())
    path.write_bytes(head + b"".join(codec.byte_view(a.data).tobytes() for a in arrays))


def as_float(a: HostArray) -> np.ndarray:
    """The values of a float array as float32 (bfloat16 is stored as its uint16 bits)."""
    if a.dtype == "bfloat16":
        return (a.data.astype(np.uint32) << 16).view(np.float32)
    return a.data.astype(np.float32)


def from_float(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(codec.DTYPES[dtype])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _zero_fill(path: Path) -> Path:
    path.write_bytes(b"\0" * path.stat().st_size)
    return path


def _random_bytes(path: Path) -> Path:
    path.write_bytes(np.random.default_rng(7).bytes(path.stat().st_size))
    return path


def _flip_payload_bits(path: Path) -> Path:
    raw = bytearray(path.read_bytes())
    for offset in (-4000, -2000, -100):  # inside the last arrays of the KV payload
        raw[offset] ^= 0x21
    path.write_bytes(bytes(raw))
    return path


def _claims_more_tokens(path: Path) -> Path:
    """A self-consistent header (name, key, checksums) for more tokens than the KV holds."""
    header, slot, arrays = read_entry(path)
    fingerprint = header["fingerprint"]
    tokens = codec.decode_tokens(header["tokens"])
    longer = np.concatenate([tokens, tokens[-5:]])
    key = entry_key(fingerprint, longer)
    header.update(tokens=codec.encode_tokens(longer), n_tokens=int(longer.shape[0]), key=key)
    return _move_to_key(path, header, slot, arrays)


def _nan_in_kv(path: Path) -> Path:
    """NaN in the keys of one layer, with every checksum rewritten to match."""
    header, slot, arrays = read_entry(path)
    a = arrays[len(arrays) // 2]
    values = as_float(a).copy()
    values.reshape(-1)[:: max(1, values.size // 7)] = np.nan
    arrays[len(arrays) // 2] = HostArray(a.name, a.dtype, a.shape, from_float(values, a.dtype))
    write_entry(path, header, slot, arrays)
    return path


def _other_model(path: Path) -> Path:
    """The same tokens as another model would store them, copied into this model's directory."""
    header, slot, arrays = read_entry(path)
    other = "another-model-0123456789abcdef"
    key = entry_key(other, codec.decode_tokens(header["tokens"]))
    header.update(fingerprint=other, key=key)
    return _move_to_key(path, header, slot, arrays)


def _move_to_key(path: Path, header: dict, slot, arrays) -> Path:
    """Replace `path` by the entry rewritten under the file name of its new `header["key"]`."""
    path.unlink()
    target = path.with_name(header["key"] + path.suffix)
    write_entry(target, header, slot, arrays)
    return target


def _wrong_dtype(path: Path) -> Path:
    """The KV converted to another float dtype, self-consistently (header, checksums)."""
    header, slot, arrays = read_entry(path)
    new = "float16" if arrays[0].dtype != "float16" else "float32"
    arrays = [HostArray(a.name, new, a.shape, from_float(as_float(a), new)) for a in arrays]
    write_entry(path, header, slot, arrays)
    return path


# name -> (damage, where it is caught: "start" = the start-up scan never indexes the file,
# "load" = it is indexed, then the restore rejects it and evicts it)
CORRUPTIONS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated": (_truncate, "start"),
    "zero-filled": (_zero_fill, "start"),
    "random-bytes": (_random_bytes, "start"),
    "flipped-payload-bits": (_flip_payload_bits, "load"),
    "header-claims-more-tokens": (_claims_more_tokens, "start"),
    "nan-in-kv": (_nan_in_kv, "load"),
    "other-model-fingerprint": (_other_model, "start"),
    "wrong-dtype": (_wrong_dtype, "load"),
}
# Text prompts with distinct first tokens: each one's entry shares no prefix with another's.
CORRUPTION_PROMPTS = {
    "truncated": "Once upon a time, a farmer",
    "zero-filled": "The weather today is",
    "random-bytes": "In the garden there are",
    "flipped-payload-bits": "My favourite vegetable is",
    "header-claims-more-tokens": "Yesterday the shop sold",
    "nan-in-kv": "Water boils when",
    "other-model-fingerprint": "Seven apples and",
    "wrong-dtype": "Rabbits like to eat",
}


def complete(base_url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete_all(base_url: str, prompts: dict[str, str]) -> dict[str, dict]:
    """`complete` of every prompt, sent at once."""
    bodies = concurrently(lambda p: complete(base_url, p), prompts.values(), len(prompts))
    return dict(zip(prompts, bodies, strict=True))


def first_token(path: Path) -> int:
    """The first token an entry file holds."""
    header, _, _ = read_entry(path)
    return int(codec.decode_tokens(header["tokens"])[0])


@functools.cache
def default_tokenizer():
    """The default model's tokenizer, loaded once for every prompt asked about."""
    from transformers import AutoTokenizer

    from tests.support.tiny_models import default_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


def prompt_token(prompt: str) -> int:
    """The first token of a text prompt (the default model's tokenizer adds no BOS)."""
    return default_tokenizer().encode(prompt)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Target:
    """The tiny llama every server of this module runs (any model name is served by it)."""
    model = make_model_dir(tmp_path_factory.mktemp("tiny-llama") / "model", "llama", seed=4)
    return Target("tiny", "tiny", ("--model", str(model), "--served-model-name", "tiny"))


@pytest.fixture(scope="module")
def reference(tiny: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model's `--no-cache` server: the reference answers of this module."""
    proc = ServerProcess(tmp_path_factory.mktemp("reference"), "--no-cache", *tiny.server_args)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture
def tiny_start(start_server, tiny: Target):
    """Servers with their own flags, on the tiny model."""
    return lambda *args, env=None: start_server(*tiny.server_args, *args, env=env)


@pytest.fixture(scope="module")
def workload(reference: ServerProcess, tiny: Target) -> list[list[Turn]]:
    return build_workload(reference.base_url, tiny)


# ====================================================================== 1. SIGKILL loop ======
# The disk budget is cut by the tiny model's KV factor, so it holds as few entries as 6 MiB of
# the default model's, and the mid-request kills wait at most 0.1 s instead of 1.5 s, so they
# still land in a request (in prefill, decode or its checkpoint write) rather than after it.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
SIGKILL_BUDGET = 6 * MiB * TINY_KV_BYTES_PER_TOKEN // 46080  # 68 KiB
MID_REQUEST_DELAY = 0.1


def test_sigkill_at_random_moments_never_fails_a_request(tmp_path, tiny, workload):
    """20 kills (seeded): mid-stream, mid-request, mid-write, right after an answer, idle."""
    loop = KillLoop(
        tmp_path,
        workload,
        seed=4,
        budget=SIGKILL_BUDGET,
        target=tiny,
        mid_request_delay=MID_REQUEST_DELAY,
    )
    report = loop.run(20)
    summary = "\n".join(report.lines() + report.problems)
    assert report.kills >= 20 and report.restarts >= 20, summary
    assert report.requests >= 20, summary
    assert report.failed_requests == 0 and report.wrong_outputs == 0, summary
    assert report.unclean_not_logged == 0, summary
    assert report.temp_files_after_restart == 0, summary
    assert report.budget_violations == 0, summary
    # A kill never damages a stored entry: nothing is dropped or evicted for failure.
    assert report.failure_evictions == 0 and report.dropped_at_start == 0, summary
    # The seeded schedule really killed writes in flight, found entries and evicted for budget.
    assert report.kills_with_write_in_flight >= 1, summary
    assert report.entries_recovered >= 1 and report.suspect_at_restart >= 1, summary
    assert report.budget_evictions >= 1, summary
    assert not report.problems, summary


# ====================================================================== 2. corruption matrix ==
def test_corruption_matrix_evicts_and_answers_correctly(tiny_start, tmp_path, reference):
    root = tmp_path / "kv"
    # The prompts are independent: each server answers them side by side (batched).
    references = {
        name: body["choices"][0]["text"]
        for name, body in complete_all(reference.base_url, CORRUPTION_PROMPTS).items()
    }
    first = tiny_start(env=cache_env(root))
    complete_all(first.base_url, CORRUPTION_PROMPTS)
    entries = wait_for_writes(first)["entries_list"]
    assert first.stop() == 0
    directory = fingerprint_dir(root)
    # A text prompt stores one entry (prompt + completion); the prompts' first tokens differ,
    # so each entry's first token says whose it is.
    assert len(entries) == len(CORRUPTION_PROMPTS), entries
    first_tokens = {first_token(directory / f"{e['key']}.kvc"): e["key"] for e in entries}
    assert len(first_tokens) == len(entries), first_tokens
    keys = {name: first_tokens[prompt_token(p)] for name, p in CORRUPTION_PROMPTS.items()}
    damaged: dict[str, tuple[Path, str]] = {}
    for name, (damage, _) in CORRUPTIONS.items():
        path = damage(directory / f"{keys[name]}.kvc")
        damaged[name] = (path, sha256(path))

    server = tiny_start(env=cache_env(root))
    indexed = {e["key"] for e in cache_stats(server)["entries_list"]}
    for name, (_, caught) in CORRUPTIONS.items():
        key = damaged[name][0].name.split(".")[0]
        assert (key in indexed) == (caught == "load"), (name, indexed)
    for name, body in complete_all(server.base_url, CORRUPTION_PROMPTS).items():
        assert body["choices"][0]["text"] == references[name], name
        # Nothing of a damaged entry was used: the whole prompt was prefilled.
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, name
    stats = wait_for_writes(server)
    assert server.stop() == 0
    log = server.log()
    for name, (path, digest) in damaged.items():
        # Explained once (at start-up or at the failed restore), never once per request.
        lines = [line for line in log.splitlines() if path.name[:16] in line]
        assert len(lines) == 1, (name, lines)
        # The damaged bytes are gone; a file of that name may only be a fresh, valid entry.
        assert not path.exists() or sha256(path) != digest, name
    assert stats["failure_evictions"] == sum(c == "load" for _, c in CORRUPTIONS.values())
    leftovers = PromptCache(root, directory.name, disk_budget=None, ram_budget=0, read_only=True)
    assert leftovers.verify() == []


# ====================================================================== 3. full disk ========
def test_full_disk_keeps_serving_then_writes_again(tiny_start, tmp_path, workload):
    """The first three entry writes fail with ENOSPC (an injected fault in the disk tier)."""
    root = tmp_path / "kv"
    conv = workload[0]
    server = tiny_start(env=cache_env(root, MLX_KVSERVE_FAULTS="disk_write_enospc:3"))
    # Turn 1 stores two checkpoints (system-prompt anchor, generation): both writes fail.
    assert answer(server.base_url, conv[0].as_messages()) == conv[0].reference
    stats = wait_for_writes(server)
    assert stats["write_errors"] == 2 and stats["disk_writes_failing"]
    assert entry_files(root) == [] and temp_files(root) == []
    # Still served: turn 2 reuses turn 1's state (RAM), its first checkpoint write fails too.
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for turn in conv[2:]:
        assert answer(server.base_url, turn.as_messages()) == turn.reference
    stats = wait_for_writes(server)
    assert stats["write_errors"] == 3 and not stats["disk_writes_failing"]
    assert stats["files_written"] >= 2 and len(entry_files(root)) >= 2
    assert temp_files(root) == []
    assert len(log_lines(server, "prompt-cache disk write failed")) == 1  # not one per request
    assert len(log_lines(server, "prompt-cache disk writes resumed")) == 1
    assert server.stop() == 0
    # What was written after space returned is a usable cache after a restart.
    again = tiny_start(env=cache_env(root))
    assert "dropped" not in again.log()
    last = conv[-1]
    body = chat(again.base_url, last.as_messages())
    assert body["choices"][0]["message"]["content"] == last.reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cache_stats(again)["restores_from_disk"] >= 1


# ====================================================================== 4. prefill fault ====
def _seeded_cache(tiny_start, root: Path, turn: Turn) -> list[dict]:
    """A cache directory holding `turn`'s checkpoints (clean stop): its entries, the shared
    system-prompt anchor first, each with the sha256 of its file."""
    server = tiny_start(env=cache_env(root))
    assert answer(server.base_url, turn.as_messages()) == turn.reference
    entries = wait_for_writes(server)["entries_list"]
    assert server.stop() == 0
    assert [e["reason"] for e in entries] == ["anchor", "generation"]
    for e in entries:
        e["content"] = content_sha256(fingerprint_dir(root) / f"{e['key']}.kvc")
    return entries


def content_sha256(path: Path) -> str:
    """The sha256 of an entry file without its slot (hits and last use, rewritten on use)."""
    raw = path.read_bytes()
    return hashlib.sha256(raw[: codec.SLOT_OFFSET] + raw[codec.PREFIX_SIZE :]).hexdigest()


def _unchanged(root: Path, entry: dict) -> bool:
    path = fingerprint_dir(root) / f"{entry['key']}.kvc"
    return path.exists() and content_sha256(path) == entry["content"]


def test_failure_right_after_disk_restore_blames_the_newest_link(tiny_start, tmp_path, workload):
    """An error after restoring the chain (system-prompt anchor, turn 1's answer): the newest
    link is blamed, the request is answered from the anchor, and only that link is evicted."""
    conv = workload[0]
    anchor, newest = _seeded_cache(tiny_start, tmp_path / "kv", conv[0])
    root = tmp_path / "kv"
    server = tiny_start(env=cache_env(root, MLX_KVSERVE_FAULTS="prefill_after_restore:1"))
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == anchor["n_tokens"]
    stats = wait_for_writes(server)
    assert stats["restores_from_disk"] >= 1
    assert _unchanged(root, anchor) and not _unchanged(root, newest)
    assert len(log_lines(server, "trying again from at most")) == 1
    evictions = [ln for ln in server.log().splitlines() if is_failure_eviction(ln)]
    assert len(evictions) == 1 and newest["key"][:16] in evictions[0]
    # The next identical request succeeds, and nothing fails again (no retry loop).
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > anchor["n_tokens"]
    assert cache_stats(server)["failure_evictions"] == stats["failure_evictions"]
    assert len(log_lines(server, "trying again")) == 1


def test_a_failure_that_also_happens_cold_is_a_clean_500_and_evicts_nothing(
    tiny_start, tmp_path, workload
):
    conv = workload[0]
    root = tmp_path / "kv"
    entries = _seeded_cache(tiny_start, root, conv[0])
    # Every try fails: from the chain, from the anchor, cold (then the fault is spent).
    server = tiny_start(env=cache_env(root, MLX_KVSERVE_FAULTS="prefill:3"))
    body = {"model": MODEL, "messages": conv[1].as_messages(), "temperature": 0, "max_tokens": 8}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["message"]
    assert all(_unchanged(root, e) for e in entries)
    assert cache_stats(server)["failure_evictions"] == 0
    assert len(log_lines(server, "not the cache's, nothing evicted")) == 1  # no loop
    # The next request works normally, from the whole chain still there.
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > entries[0]["n_tokens"]
    assert cache_stats(server)["failure_evictions"] == 0


FIRST_ASK = (
    "Hello. I am planning a small balcony garden with tomatoes, basil, mint and a lemon tree "
    "in pots, facing south, and I would like some advice on where to start this spring."
)
# A system prompt of about 500 tokens under a two-turn conversation: the shape of the measured
# case (a 618-token turn, a 508-token system prompt shared with other conversations).
LONG_SYSTEM = (
    "You are the assistant of a gardening shop. Answer in one short sentence. "
    + " ".join(
        f"Rule {i}: be kind to plant number {i} and water it on day {i % 7}." for i in range(24)
    )
)


def test_a_link_that_prefills_non_finite_logits_costs_only_its_own_tokens(
    tiny_start, tmp_path, reference
):
    """The measured case. Turn 1's answer is stored as the newest link of a chain under a long
    system prompt; its file is then damaged so that it passes every check but prefills
    non-finite logits. Turn 2 is answered exactly as without a cache, and prefills only the
    tokens after the system prompt: the anchor, valid on disk, is reused and kept."""
    root = tmp_path / "kv"
    first = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": FIRST_ASK}]
    reply = answer(reference.base_url, first)
    second = [*first, {"role": "assistant", "content": reply}]
    second.append({"role": "user", "content": "Which pots do you sell, and are they big?"})
    expected = answer(reference.base_url, second)

    server = tiny_start(env=cache_env(root))
    assert answer(server.base_url, first) == reply
    anchor, newest = wait_for_writes(server)["entries_list"]
    assert server.stop() == 0
    assert (anchor["reason"], newest["reason"]) == ("anchor", "generation")
    anchor_sha = content_sha256(fingerprint_dir(root) / f"{anchor['key']}.kvc")
    poison_entry(fingerprint_dir(root) / f"{newest['key']}.kvc")

    server = tiny_start(env=cache_env(root))
    assert cache_stats(server)["entries"] == 2  # it passes the start-up checks
    body = chat(server.base_url, second)
    assert body["choices"][0]["message"]["content"] == expected
    usage = body["usage"]
    reprefilled = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    print(
        f"prompt {usage['prompt_tokens']} tokens, system-prompt anchor {anchor['n_tokens']}, "
        f"bad link {newest['n_tokens'] - anchor['n_tokens']} tokens: re-prefilled {reprefilled}"
    )
    assert usage["prompt_tokens_details"]["cached_tokens"] == anchor["n_tokens"]
    assert content_sha256(fingerprint_dir(root) / f"{anchor['key']}.kvc") == anchor_sha
    evictions = [ln for ln in server.log().splitlines() if is_failure_eviction(ln)]
    assert len(evictions) == 1 and newest["key"][:16] in evictions[0]
    assert "non-finite logits" in evictions[0]
    kept = {e["key"] for e in wait_for_writes(server)["entries_list"]}
    assert anchor["key"] in kept


# ====================================================================== 5. unclean shutdown ==
def _tamper_finite(path: Path) -> None:
    """Replace the KV with finite noise of the same scale; rewrite every checksum to match."""
    header, slot, arrays = read_entry(path)
    rng = np.random.default_rng(3)
    noisy = []
    for a in arrays:
        values = as_float(a)
        scale = float(np.std(values)) or 1.0
        noise = rng.standard_normal(values.shape).astype(np.float32) * scale
        noisy.append(HostArray(a.name, a.dtype, a.shape, from_float(noise, a.dtype)))
    write_entry(path, header, slot, noisy)


@pytest.fixture(scope="module")
def default_turns(nocache_server: ServerProcess) -> list[list[Turn]]:
    """Two turns of two conversations, answered by the default model."""
    return build_workload(nocache_server.base_url, conversations=2, turns=2)


def test_entries_of_a_killed_run_are_verified_at_first_use(start_server, tmp_path, default_turns):
    """On the default model: the behaviour check needs a model whose answer depends on its KV
    (a tiny random one's barely does) and answers that read back as the same tokens in the
    next turn's history (a random model's do not)."""
    root = tmp_path / "kv"
    a, b = default_turns
    first = start_server(env=cache_env(root))
    for turn in (a[0], b[0]):
        assert answer(first.base_url, turn.as_messages()) == turn.reference
    entries = wait_for_writes(first)["entries_list"]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    # Checkpoints: the shared system-prompt anchor, then each conversation's generation entry.
    anchor, gen_a, gen_b = (e["key"] for e in entries)
    assert [e["reason"] for e in entries] == ["anchor", "generation", "generation"]
    _tamper_finite(fingerprint_dir(root) / f"{gen_a}.kvc")  # only a behaviour check sees it

    server = start_server(env=cache_env(root))
    stats = cache_stats(server)
    assert stats["unclean_start"] and stats["suspect"] == 3
    # The same prompt again stops short of the tampered entry's probe, so that entry is not
    # used at all: only its checkable link (the anchor) is restored and verified.
    body = chat(server.base_url, a[0].as_messages())
    assert body["choices"][0]["message"]["content"] == a[0].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == entries[0]["n_tokens"]
    stats = cache_stats(server)
    assert stats["suspect"] == 2 and stats["failure_evictions"] == 0
    # An intact suspect chain: restored, its probe matches, it is verified.
    body = chat(server.base_url, b[1].as_messages())
    assert body["choices"][0]["message"]["content"] == b[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= entries[2]["n_tokens"]
    stats = cache_stats(server)
    assert stats["suspect"] == 1 and stats["failure_evictions"] == 0
    assert {e["key"]: e["suspect"] for e in stats["entries_list"]}[gen_a]
    # The tampered one passes every checksum, but not the probe: evicted from its first
    # suspect link (itself); the longest verified prefix left (the shared system prompt, and
    # the chat-template tokens conversation b has in common) serves the request instead.
    body = chat(server.base_url, a[1].as_messages())
    assert body["choices"][0]["message"]["content"] == a[1].reference
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert entries[0]["n_tokens"] <= cached < entries[1]["n_tokens"]
    lines = log_lines(server, "behaviour check failed after an unclean shutdown")
    assert len(lines) == 1 and gen_a[:16] in lines[0]
    assert not (fingerprint_dir(root) / f"{gen_a}.kvc").exists()
    stats = cache_stats(server)
    kept = {e["key"] for e in stats["entries_list"]}
    assert stats["suspect"] == 0 and gen_a not in kept and {anchor, gen_b} <= kept


def test_damaged_conversation_falls_back_to_its_system_prompt(tiny_start, tmp_path, workload):
    """A link that fails to load costs only itself: the request goes on from the longest
    prefix left (the system-prompt anchor), not from a cold prefill."""
    root = tmp_path / "kv"
    a = workload[0]
    first = tiny_start(env=cache_env(root))
    assert answer(first.base_url, a[0].as_messages()) == a[0].reference
    entries = wait_for_writes(first)["entries_list"]
    assert first.stop() == 0
    assert [e["reason"] for e in entries] == ["anchor", "generation"]
    anchor, gen = entries
    _flip_payload_bits(fingerprint_dir(root) / f"{gen['key']}.kvc")

    server = tiny_start(env=cache_env(root))
    body = chat(server.base_url, a[1].as_messages())
    assert body["choices"][0]["message"]["content"] == a[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == anchor["n_tokens"]
    lines = log_lines(server, "payload checksum mismatch")
    assert len(lines) == 1 and gen["key"][:16] in lines[0]
    kept = {e["key"] for e in wait_for_writes(server)["entries_list"]}
    assert anchor["key"] in kept and gen["key"] not in kept


def test_no_orphan_written_after_a_failed_parent_write(tmp_path, monkeypatch):
    """In-process: a delta queued while its parent's write was still failing is not written.

    A large checkpoint write can take long enough for the engine to queue the next checkpoint
    (a delta on top of it) before the disk fills; that delta must not land as an orphan file
    that start-up would only delete, and later checkpoints must be written whole again.
    """
    from mlx_kvserve.cache.disk import DiskTier
    from tests.support.cache_testing import kv_arrays, make_kv

    gate = threading.Event()
    real = DiskTier.write_entry
    calls = []

    def parent_fails_slowly(self, key, head, arrays, job):
        calls.append(key)
        if len(calls) == 1:
            gate.wait(30)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, key, head, arrays, job)

    monkeypatch.setattr(DiskTier, "write_entry", parent_fails_slowly)
    tokens = list(range(1000, 1400))
    pc = PromptCache(tmp_path, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB)
    parent = pc.checkpoint(tokens[:100], make_kv(100), "message")
    child = pc.checkpoint(tokens[:200], make_kv(200), "message")  # parent still pending
    assert {e.key: e.parent for e in pc.entries()}[child] == parent
    gate.set()
    pc.flush()
    assert not (tmp_path / "model-a" / f"{child}.kvc").exists()  # would be an orphan
    # Both are still served from RAM, and the next checkpoint is written whole.
    assert pc.lookup(tokens[:250]).usable == 200
    last = pc.checkpoint(tokens[:300], make_kv(300), "message")
    pc.flush()
    info = {e.key: e for e in pc.entries()}[last]
    assert info.disk == "written" and info.parent is None
    pc.close()
    pc = PromptCache(tmp_path, "model-a", disk_budget=64 * MiB, ram_budget=0)
    m = pc.lookup(tokens[:350])
    assert m.usable == 300
    from mlx_lm.models.cache import KVCache

    caches = pc.restore(m, [KVCache(), KVCache()])
    for got, want in zip(kv_arrays(caches), kv_arrays(make_kv(300)), strict=True):
        assert np.array_equal(got, want)
    pc.close()
