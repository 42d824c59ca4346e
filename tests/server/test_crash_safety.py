"""Crash safety against real server processes and the real model (issue 4, DESIGN invariants 5-6).

Every answer is a greedy completion compared with the answer of a `--no-cache` server to the same
request, so no kill, damaged file or injected fault can buy anything with wrong output. The
kill-and-restart loop (`KillLoop`) is shared with `scripts/soak.py`, which runs it for longer.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlx_kvserve.cache import PromptCache, codec
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.entry import entry_key
from tests.support.cache_testing import poison_entry
from tests.support.servers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
TIMEOUT = 300.0  # a guard against a hung server, never a speed assertion
MiB = 1 << 20

SYSTEM = {
    "role": "system",
    "content": "You are a terse assistant for a gardening shop. Answer in one short sentence.",
}
# A few conversations sharing one system prompt; each grows turn by turn.
CONVERSATIONS = [
    ["Which pots do you sell?", "Are they big?", "What colours?", "Thanks."],
    ["Do you have tomato seeds?", "When should I plant them?", "How deep?", "Thanks."],
    ["When do you open?", "And on Sundays?", "Is there parking?", "Bye."],
]


# ====================================================================== client helpers ======
class RequestFailed(Exception):
    """A request the server should have answered did not get a normal answer."""


def chat(base_url: str, messages: list[dict], *, max_tokens: int = MAX_TOKENS) -> dict:
    """One greedy, non-streamed chat completion; returns the response body (raises if not 200)."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    if resp.status_code != 200:
        raise RequestFailed(f"HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def answer(base_url: str, messages: list[dict]) -> str:
    return chat(base_url, messages)["choices"][0]["message"]["content"]


def stream_chat(
    base_url: str, messages: list[dict], *, on_chunk: Callable[[int], bool] | None = None
) -> str | None:
    """A streamed greedy completion; returns its text, or None if `on_chunk(n)` said stop."""
    body = {
        "model": MODEL,
        "messages": messages,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    parts: list[str] = []
    n = 0
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as resp:
        if resp.status_code != 200:
            raise RequestFailed(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestFailed(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    parts.append(text)
                    n += 1
                    if on_chunk is not None and on_chunk(n):
                        return None
    return "".join(parts)


def cache_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/cache", timeout=TIMEOUT).json()


def fingerprint_dir(cache_root: Path) -> Path:
    """The one model directory under a cache root."""
    dirs = [d for d in cache_root.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def entry_files(cache_root: Path) -> list[Path]:
    if not cache_root.exists():
        return []
    return sorted(p for d in cache_root.iterdir() if d.is_dir() for p in d.glob("*.kvc"))


def temp_files(cache_root: Path) -> list[Path]:
    if not cache_root.exists():
        return []
    return sorted(p for d in cache_root.iterdir() if d.is_dir() for p in d.glob(".tmp.*"))


def disk_bytes(cache_root: Path) -> int:
    total = 0
    for p in entry_files(cache_root):
        with contextlib.suppress(FileNotFoundError):  # evicted while listing
            total += p.stat().st_size
    return total


def log_lines(server: ServerProcess, needle: str) -> list[str]:
    return [line for line in server.log().splitlines() if needle in line]


# ====================================================================== the workload =========
@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    messages: tuple  # of (role, content)
    reference: str  # the --no-cache server's greedy answer

    def as_messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages]


def build_workload(reference_url: str) -> list[list[Turn]]:
    """Every turn of every conversation, with the no-cache answers also used as history."""
    workload = []
    for ci, questions in enumerate(CONVERSATIONS):
        history = [(SYSTEM["role"], SYSTEM["content"])]
        turns = []
        for ti, question in enumerate(questions):
            history.append(("user", question))
            messages = tuple(history)
            ref = answer(reference_url, [{"role": r, "content": c} for r, c in messages])
            turns.append(Turn(ci, ti, messages, ref))
            history.append(("assistant", ref))
        workload.append(turns)
    return workload


KILL_MODES = ("after_response", "mid_stream", "mid_request", "mid_write", "idle")
WRITE_KILL_LINE = "injected fault at disk_write_kill: SIGKILL"


@dataclass
class SoakReport:
    kills: int = 0
    restarts: int = 0
    requests: int = 0
    failed_requests: int = 0
    wrong_outputs: int = 0
    entries_recovered: int = 0  # entries indexed at each restart, summed
    suspect_at_restart: int = 0  # of those, flagged suspect (written by a run that died)
    failure_evictions: int = 0  # "prompt-cache evicted <key>: <why>" log lines
    dropped_at_start: int = 0  # files dropped at start-up as damaged or orphaned
    budget_evictions: int = 0  # entries evicted to keep the disk budget
    kills_with_write_in_flight: int = 0  # a temporary file existed right after the kill
    temp_files_after_restart: int = 0
    budget_violations: int = 0  # restarts that found more bytes on disk than the budget
    unclean_not_logged: int = 0  # restarts whose log did not say the last run died
    modes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"kills:                          {self.kills}",
            f"  by moment:                    {json.dumps(self.modes, sort_keys=True)}",
            f"  with a write in flight:       {self.kills_with_write_in_flight}",
            f"restarts:                       {self.restarts}",
            f"requests:                       {self.requests}",
            f"failed requests:                {self.failed_requests}",
            f"wrong outputs:                  {self.wrong_outputs}",
            f"entries recovered at restarts:  {self.entries_recovered}",
            f"  of them suspect:              {self.suspect_at_restart}",
            f"entries evicted (failure):      {self.failure_evictions}",
            f"files dropped at start-up:      {self.dropped_at_start}",
            f"entries evicted (budget):       {self.budget_evictions}",
            f"temp files after restarts:      {self.temp_files_after_restart}",
            f"budget violations:              {self.budget_violations}",
            f"unclean start not logged:       {self.unclean_not_logged}",
        ]


class KillLoop:
    """Run the workload against a cache server, SIGKILL it at seeded random moments, restart.

    Each cycle (re)starts the server on the same cache directory, checks what a restart must
    guarantee (an unclean-shutdown log line, no temporary files, the disk budget), sends zero
    or one request, then one more (the one the previous kill interrupted, if any, goes first)
    and kills the server at a moment chosen from KILL_MODES:

    * after_response: as soon as the answer arrives (its "generation" checkpoint is being
      stored and written just then);
    * mid_stream: after a random number of streamed chunks;
    * mid_request: after a random delay (in prefill, decode or a checkpoint write);
    * mid_write: the server kills itself halfway through writing its K-th entry file
      (`MLX_KVSERVE_FAULTS=disk_write_kill@K`), so a torn temporary file is certain;
    * idle: after the answer, with nothing in flight but possibly the writer.

    Every request that was not deliberately interrupted must succeed with the no-cache answer.
    """

    def __init__(
        self,
        workdir: Path,
        workload: list[list[Turn]],
        *,
        seed: int = 0,
        budget: int = 6 * MiB,
        env: dict[str, str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.workdir = workdir
        self.cache_root = workdir / "kv"
        self.workload = workload
        self.seed = seed
        self.cycles = 0
        self.rng = random.Random(seed)
        self.budget = budget
        self.env = {"MLX_KVSERVE_CACHE_DIR": str(self.cache_root), **(env or {})}
        # Debug logging: budget evictions are logged (one line each) only at that level.
        self.args = ("--cache-budget", str(budget), "--log-level", "debug")
        self.report = SoakReport()
        self.log = log or (lambda _msg: None)
        self._next_turn = [0] * len(workload)
        self._retry: Turn | None = None
        self.server: ServerProcess | None = None

    # -- workload order -----------------------------------------------------------------------
    def _pick(self) -> Turn:
        """The interrupted request first; else the next turn of a random conversation.

        A finished conversation starts over, so later prompts are also shorter than what is
        cached (trimmed back) or identical to it (an exact hit).
        """
        if self._retry is not None:
            turn, self._retry = self._retry, None
            return turn
        ci = self.rng.randrange(len(self.workload))
        turns = self.workload[ci]
        turn = turns[self._next_turn[ci] % len(turns)]
        self._next_turn[ci] += 1
        return turn

    def _problem(self, text: str) -> None:
        self.report.problems.append(text)
        self.log("PROBLEM: " + text)

    def _check(self, turn: Turn, got: str | None, error: BaseException | None) -> None:
        self.report.requests += 1
        where = f"conversation {turn.conversation} turn {turn.index}"
        if error is not None:
            self.report.failed_requests += 1
            self._problem(f"{where}: request failed: {error!r}")
        elif got != turn.reference:
            self.report.wrong_outputs += 1
            self._problem(f"{where}: got {got!r}, no-cache answer {turn.reference!r}")

    def _ask(self, turn: Turn) -> tuple[str | None, BaseException | None]:
        assert self.server is not None
        try:
            return answer(self.server.base_url, turn.as_messages()), None
        except Exception as exc:  # noqa: BLE001 - counted and reported by the caller
            return None, exc

    def _send(self, turn: Turn) -> None:
        self._check(turn, *self._ask(turn))

    # -- server lifecycle ----------------------------------------------------------------------
    def start(self, faults: str = "") -> ServerProcess:
        restart = self.cache_root.exists()
        env = {**self.env, "MLX_KVSERVE_FAULTS": faults} if faults else self.env
        self.server = ServerProcess(self.workdir, *self.args, env=env).wait_ready()
        if not restart:
            return self.server
        r = self.report
        r.restarts += 1
        text = self.server.log()
        if "the last run ended uncleanly" not in text:
            r.unclean_not_logged += 1
            self._problem(f"restart {r.restarts}: no unclean-shutdown line in the log")
        stats = cache_stats(self.server)
        r.entries_recovered += stats["entries"]
        r.suspect_at_restart += stats["suspect"]
        r.dropped_at_start += text.count("prompt-cache dropped damaged file")
        r.dropped_at_start += text.count("prompt-cache dropped orphan")
        leftovers = temp_files(self.cache_root)
        if leftovers:
            r.temp_files_after_restart += len(leftovers)
            self._problem(f"restart {r.restarts}: temporary files left: {leftovers}")
        used = disk_bytes(self.cache_root)
        if used > self.budget:
            r.budget_violations += 1
            self._problem(f"restart {r.restarts}: {used} bytes on disk, budget {self.budget}")
        return self.server

    def _ended(self) -> None:
        """Book-keeping once the server process is gone (killed or stopped)."""
        assert self.server is not None
        self.server.stop()  # closes the log handle
        lines = self.server.log().splitlines()
        self.report.failure_evictions += sum(_is_failure_eviction(ln) for ln in lines)
        self.report.budget_evictions += sum("(disk budget)" in ln for ln in lines)
        self.server = None

    def kill(self) -> None:
        assert self.server is not None
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait()
        self._killed()

    def _killed(self) -> None:
        self.report.kills += 1
        if temp_files(self.cache_root):
            self.report.kills_with_write_in_flight += 1
        self._ended()

    # -- one cycle -----------------------------------------------------------------------------
    def cycle(self) -> None:
        # Each cycle draws from its own seeded generator, so the schedule of kill moments (and
        # of conversations) does not depend on how earlier cycles happened to end.
        self.cycles += 1
        self.rng = random.Random(self.seed * 1_000_003 + self.cycles)
        mode = self.rng.choice(KILL_MODES)
        self.report.modes[mode] = self.report.modes.get(mode, 0) + 1
        if mode == "mid_write":
            self._cycle_mid_write()
        else:
            self.start()
            for _ in range(self.rng.randint(0, 1)):
                self._send(self._pick())
            getattr(self, f"_kill_{mode}")(self._pick())

    def _kill_after_response(self, turn: Turn) -> None:
        got, error = self._ask(turn)
        self.kill()
        self._check(turn, got, error)

    def _kill_idle(self, turn: Turn) -> None:
        self._send(turn)
        self.kill()

    def _kill_mid_stream(self, turn: Turn) -> None:
        assert self.server is not None
        stop_after = self.rng.randint(1, MAX_TOKENS)

        def on_chunk(n: int) -> bool:
            if n >= stop_after:
                self.kill()
                return True
            return False

        got: str | None = None
        error: BaseException | None = None
        try:
            got = stream_chat(self.server.base_url, turn.as_messages(), on_chunk=on_chunk)
        except Exception as exc:  # noqa: BLE001 - counted unless the kill caused it
            error = exc
        if self.server is None:
            self._retry = turn  # interrupted on purpose: send it again after the restart
        else:  # the answer ended before the chosen chunk
            self.kill()
            self._check(turn, got, error)

    def _kill_mid_request(self, turn: Turn) -> None:
        delay = self.rng.uniform(0.0, 1.5)
        result: dict = {}

        def run() -> None:
            result["got"], result["error"] = self._ask(turn)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join(delay)
        finished = not worker.is_alive()
        self.kill()
        worker.join()
        if finished:
            self._check(turn, result["got"], result["error"])
        else:
            self._retry = turn

    def _cycle_mid_write(self) -> None:
        """The server SIGKILLs itself halfway through its K-th entry write."""
        k = self.rng.randint(1, 3)
        self.start(faults=f"disk_write_kill@{k}")
        assert self.server is not None
        for _ in range(4):
            turn = self._pick()
            got, error = self._ask(turn)
            if error is not None:  # the connection drops a moment before the process is reaped
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.server.proc.wait(10)
            if self.server.proc.poll() is None:
                self._check(turn, got, error)
                continue
            if self.server.proc.returncode == -signal.SIGKILL and WRITE_KILL_LINE in (
                self.server.log()
            ):
                if error is None:
                    self._check(turn, got, error)  # answered before the write that died
                else:
                    self._retry = turn
                self._killed()
            else:
                self._check(turn, got, error or RuntimeError("the server died on its own"))
                self._ended()
            return
        self.kill()  # fewer than K writes happened: an ordinary kill

    def run(self, kills: int, *, final_pass: bool = False) -> SoakReport:
        """`kills` kill-restart cycles, then a clean restart (and the whole workload once)."""
        try:
            while self.report.kills < kills:
                self.cycle()
                self.log(
                    f"kill {self.report.kills}: requests {self.report.requests}, "
                    f"problems {len(self.report.problems)}"
                )
            server = self.start()
            if self._retry is not None:
                self._send(self._pick())
            if final_pass:
                for turns in self.workload:
                    for turn in turns:
                        self._send(turn)
            if server.stop() != 0:
                self._problem("the final server did not stop cleanly")
            self._ended()
            if temp_files(self.cache_root):
                self._problem("temporary files left after a clean stop")
            if disk_bytes(self.cache_root) > self.budget:
                self.report.budget_violations += 1
                self._problem("over budget after a clean stop")
        finally:
            if self.server is not None and self.server.proc.poll() is None:
                self.server.stop()
        return self.report


def _is_failure_eviction(line: str) -> bool:
    return "WARNING" in line and "prompt-cache evicted" in line


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


def wait_for_writes(server: ServerProcess) -> dict:
    """/v1/cache once every queued checkpoint write has landed (or failed)."""
    for _ in range(600):
        stats = cache_stats(server)
        if stats["pending_writes"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"checkpoint writes still pending: {stats}")


def cache_env(root: Path, **extra: str) -> dict[str, str]:
    return {"MLX_KVSERVE_CACHE_DIR": str(root), **extra}


@pytest.fixture(scope="module")
def workload(nocache_server: ServerProcess) -> list[list[Turn]]:
    return build_workload(nocache_server.base_url)


# ====================================================================== 1. SIGKILL loop ======
def test_sigkill_at_random_moments_never_fails_a_request(tmp_path, workload):
    """20 kills (seeded): mid-stream, mid-request, mid-write, right after an answer, idle."""
    report = KillLoop(tmp_path, workload, seed=4, budget=6 * MiB).run(20)
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
def test_corruption_matrix_evicts_and_answers_correctly(start_server, tmp_path, nocache_server):
    root = tmp_path / "kv"
    references = {
        name: complete(nocache_server.base_url, p)["choices"][0]["text"]
        for name, p in CORRUPTION_PROMPTS.items()
    }
    first = start_server(env=cache_env(root))
    keys: dict[str, str] = {}
    for name, prompt in CORRUPTION_PROMPTS.items():
        complete(first.base_url, prompt)
        known = set(keys.values())
        new = [e["key"] for e in wait_for_writes(first)["entries_list"] if e["key"] not in known]
        assert len(new) == 1, new  # a text prompt stores one entry: prompt + completion
        keys[name] = new[0]
    assert first.stop() == 0
    directory = fingerprint_dir(root)
    damaged: dict[str, tuple[Path, str]] = {}
    for name, (damage, _) in CORRUPTIONS.items():
        path = damage(directory / f"{keys[name]}.kvc")
        damaged[name] = (path, sha256(path))

    server = start_server(env=cache_env(root))
    indexed = {e["key"] for e in cache_stats(server)["entries_list"]}
    for name, (_, caught) in CORRUPTIONS.items():
        key = damaged[name][0].name.split(".")[0]
        assert (key in indexed) == (caught == "load"), (name, indexed)
    for name, prompt in CORRUPTION_PROMPTS.items():
        body = complete(server.base_url, prompt)
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
def test_full_disk_keeps_serving_then_writes_again(start_server, tmp_path, workload):
    """The first three entry writes fail with ENOSPC (an injected fault in the disk tier)."""
    root = tmp_path / "kv"
    conv = workload[0]
    server = start_server(env=cache_env(root, MLX_KVSERVE_FAULTS="disk_write_enospc:3"))
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
    again = start_server(env=cache_env(root))
    assert "dropped" not in again.log()
    last = conv[-1]
    body = chat(again.base_url, last.as_messages())
    assert body["choices"][0]["message"]["content"] == last.reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cache_stats(again)["restores_from_disk"] >= 1


# ====================================================================== 4. prefill fault ====
def _seeded_cache(start_server, root: Path, turn: Turn) -> list[dict]:
    """A cache directory holding `turn`'s checkpoints (clean stop): its entries, the shared
    system-prompt anchor first, each with the sha256 of its file."""
    server = start_server(env=cache_env(root))
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


def test_failure_right_after_disk_restore_blames_the_newest_link(start_server, tmp_path, workload):
    """An error after restoring the chain (system-prompt anchor, turn 1's answer): the newest
    link is blamed, the request is answered from the anchor, and only that link is evicted."""
    conv = workload[0]
    anchor, newest = _seeded_cache(start_server, tmp_path / "kv", conv[0])
    root = tmp_path / "kv"
    server = start_server(env=cache_env(root, MLX_KVSERVE_FAULTS="prefill_after_restore:1"))
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == anchor["n_tokens"]
    stats = wait_for_writes(server)
    assert stats["restores_from_disk"] >= 1
    assert _unchanged(root, anchor) and not _unchanged(root, newest)
    assert len(log_lines(server, "trying again from at most")) == 1
    evictions = [ln for ln in server.log().splitlines() if _is_failure_eviction(ln)]
    assert len(evictions) == 1 and newest["key"][:16] in evictions[0]
    # The next identical request succeeds, and nothing fails again (no retry loop).
    body = chat(server.base_url, conv[1].as_messages())
    assert body["choices"][0]["message"]["content"] == conv[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > anchor["n_tokens"]
    assert cache_stats(server)["failure_evictions"] == stats["failure_evictions"]
    assert len(log_lines(server, "trying again")) == 1


def test_a_failure_that_also_happens_cold_is_a_clean_500_and_evicts_nothing(
    start_server, tmp_path, workload
):
    conv = workload[0]
    root = tmp_path / "kv"
    entries = _seeded_cache(start_server, root, conv[0])
    # Every try fails: from the chain, from the anchor, cold (then the fault is spent).
    server = start_server(env=cache_env(root, MLX_KVSERVE_FAULTS="prefill:3"))
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
    start_server, tmp_path, nocache_server
):
    """The measured case. Turn 1's answer is stored as the newest link of a chain under a long
    system prompt; its file is then damaged so that it passes every check but prefills
    non-finite logits. Turn 2 is answered exactly as without a cache, and prefills only the
    tokens after the system prompt: the anchor, valid on disk, is reused and kept."""
    root = tmp_path / "kv"
    first = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": FIRST_ASK}]
    reply = answer(nocache_server.base_url, first)
    second = [*first, {"role": "assistant", "content": reply}]
    second.append({"role": "user", "content": "Which pots do you sell, and are they big?"})
    expected = answer(nocache_server.base_url, second)

    server = start_server(env=cache_env(root))
    assert answer(server.base_url, first) == reply
    anchor, newest = wait_for_writes(server)["entries_list"]
    assert server.stop() == 0
    assert (anchor["reason"], newest["reason"]) == ("anchor", "generation")
    anchor_sha = content_sha256(fingerprint_dir(root) / f"{anchor['key']}.kvc")
    poison_entry(fingerprint_dir(root) / f"{newest['key']}.kvc")

    server = start_server(env=cache_env(root))
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
    evictions = [ln for ln in server.log().splitlines() if _is_failure_eviction(ln)]
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


def test_entries_of_a_killed_run_are_verified_at_first_use(start_server, tmp_path, workload):
    root = tmp_path / "kv"
    a, b = workload[0], workload[1]
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


def test_damaged_conversation_falls_back_to_its_system_prompt(start_server, tmp_path, workload):
    """A link that fails to load costs only itself: the request goes on from the longest
    prefix left (the system-prompt anchor), not from a cold prefill."""
    root = tmp_path / "kv"
    a = workload[0]
    first = start_server(env=cache_env(root))
    assert answer(first.base_url, a[0].as_messages()) == a[0].reference
    entries = wait_for_writes(first)["entries_list"]
    assert first.stop() == 0
    assert [e["reason"] for e in entries] == ["anchor", "generation"]
    anchor, gen = entries
    _flip_payload_bits(fingerprint_dir(root) / f"{gen['key']}.kvc")

    server = start_server(env=cache_env(root))
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
