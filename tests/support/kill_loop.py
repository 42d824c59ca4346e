"""The kill-and-restart loop of the crash tests and the soak (tests/server/test_crash_safety.py,
scripts/soak.py), and the cache-directory helpers they share.

`KillLoop` runs a workload (tests/support/soak_workload.py) against a cache server, SIGKILLs it
at seeded random moments and restarts it on the same cache directory; every answer must equal
the `--no-cache` server's, and every restart must find what a crash may leave (DESIGN invariant
6).
"""

from __future__ import annotations

import contextlib
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

from tests.support.servers import ServerProcess
from tests.support.soak_workload import (
    DEFAULT,
    TIMEOUT,
    Answer,
    Target,
    Turn,
    ask,
    stream_chat,
)

MiB = 1 << 20


# ====================================================================== the cache directory ==
def cache_stats(server: ServerProcess) -> dict:
    """The server's /v1/cache, asked again while it answers 503 (its engine busy past the
    endpoint's 30 s wait, as on a loaded machine right after a start), as a client would."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        resp = httpx.get(server.base_url + "/v1/cache", timeout=TIMEOUT)
        if resp.status_code != 503 or time.monotonic() > deadline:
            assert resp.status_code == 200, resp.text
            return resp.json()
        time.sleep(float(resp.headers.get("retry-after", "1")))


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


# ====================================================================== the loop =============
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
    * mid_request: after a random delay of up to `mid_request_delay` seconds (in prefill,
      decode or a checkpoint write; 1.5 s suits the default model, a tiny model answers in
      a fraction of that);
    * mid_write: the server kills itself halfway through writing its K-th entry file
      (`MLX_KVSERVE_FAULTS=disk_write_kill@K`), so a torn temporary file is certain;
    * idle: after the answer, with nothing in flight but possibly the writer.

    Every request that was not deliberately interrupted must succeed with the no-cache answer
    (compared as an `Answer`: content, reasoning, tool calls). The `target` says which model
    the server loads and what the requests carry.
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
        target: Target = DEFAULT,
        mid_request_delay: float = 1.5,
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
        self.target = target
        self.mid_request_delay = mid_request_delay
        self.args = ("--cache-budget", str(budget), "--log-level", "debug", *target.server_args)
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

    def _check(self, turn: Turn, got: Answer | None, error: BaseException | None) -> None:
        self.report.requests += 1
        where = f"conversation {turn.conversation} turn {turn.index}"
        if error is not None:
            self.report.failed_requests += 1
            self._problem(f"{where}: request failed: {error!r}")
        elif got != turn.expected:
            self.report.wrong_outputs += 1
            self._problem(f"{where}: got {got!r}, no-cache answer {turn.expected!r}")

    def _ask(self, turn: Turn) -> tuple[Answer | None, BaseException | None]:
        assert self.server is not None
        try:
            return ask(self.server.base_url, turn.as_messages(), self.target), None
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
        self.report.failure_evictions += sum(is_failure_eviction(ln) for ln in lines)
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
        stop_after = self.rng.randint(1, self.target.max_tokens)

        def on_chunk(n: int) -> bool:
            if n >= stop_after:
                self.kill()
                return True
            return False

        got: Answer | None = None
        error: BaseException | None = None
        try:
            got = stream_chat(
                self.server.base_url, turn.as_messages(), target=self.target, on_chunk=on_chunk
            )
        except Exception as exc:  # noqa: BLE001 - counted unless the kill caused it
            error = exc
        if self.server is None:
            self._retry = turn  # interrupted on purpose: send it again after the restart
        else:  # the answer ended before the chosen chunk
            self.kill()
            self._check(turn, got, error)

    def _kill_mid_request(self, turn: Turn) -> None:
        delay = self.rng.uniform(0.0, self.mid_request_delay)
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

    def run(
        self, kills: int, *, final_pass: bool = False, stop: Callable[[], bool] | None = None
    ) -> SoakReport:
        """`kills` kill-restart cycles (fewer once `stop()` says so), then a clean restart (and
        the whole workload once)."""
        try:
            while self.report.kills < kills and not (stop is not None and stop()):
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


def is_failure_eviction(line: str) -> bool:
    return "WARNING" in line and "prompt-cache evicted" in line
