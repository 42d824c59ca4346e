"""Every fault point of a request's life, under every kind of fault it takes (engine/faults.py).

The real Engine serves the tiny llama of the engine tests from a prompt cache on disk that an
earlier run left (a system-prompt anchor, a two-turn conversation after it). Three requests come
at once: one shares the anchor, one continues the conversation (a chain of four links, read from
disk, the anchor in pieces and the others whole after a read-ahead hint), one shares nothing.
The KV budget pauses the youngest mid-answer and resumes it from its checkpoint; the disk budget
evicts as new checkpoints land. So one workload reaches every point (checked first).

Each case arms one rule, once (`point:1`, the first reach; a prefill chunk: each K-th, `@K`) or
for good (`point:1000`: a disk that stays full, a device that keeps failing), at an engine point
(its error, and Metal running out of memory where it has that kind) or a disk step (ENOSPC, EIO,
EACCES). Every request must end, within a bounded wait, with its normal answer (mlx-lm's own
greedy answer) or a clean error event, as the point's outcome below says; no KV hold, paused or
queued request is left behind; the disk and the cache's bookkeeping agree; the engine says the
truth about itself (alive, or stopped with the cause); and the next request is served (or,
stopped, refused at once). The points are read from engine/faults.py, so a new point without an
outcome here fails; the package's source is read too, so a point reached nowhere, or reached
but not declared, fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache import restore as restore_module
from mlx_kvserve.engine import Engine, faults
from mlx_kvserve.engine.failures import BLAMELESS_TURNS
from mlx_kvserve.engine.requests import Done, EngineError, SamplingParams
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.worker import EngineNotReady
from tests.support.cache_testing import assert_disk_consistent, inject_faults
from tests.unit.test_engine_failures import final, submit_together
from tests.unit.test_engine_units import Recorder, StubTokenizer, reference, tiny_model, tokens_of

PACKAGE = Path(__file__).resolve().parents[2] / "mlx_kvserve"
FINGERPRINT = "tiny-fault-matrix"
PER_TOKEN = 256  # KV bytes per position of the tiny llama (both layers)
SYSTEM = [(5 * i + 1) % 97 for i in range(24)]
ANSWER = 16  # tokens per answer of a case's requests
WARM_ANSWER = 4  # the earlier run's answers: links of 11 tokens, smaller than the anchor
# Three rows of 108 positions fit, one more reserve of 8 does not: the youngest pauses.
KV_BUDGET = 330 * PER_TOKEN
DISK_BUDGET = 60_000  # the earlier run's 18 KiB and about two new entries: the rest evicts
SMALL_LINK_BYTES = 4096  # the anchor (6 KiB) is read in pieces, its header first
ONCE, ALWAYS = "once", "always"
END_WAIT = 30.0  # seconds: a request still running after this hangs

# What a fault at each point does to the requests it touches, once (see engine/faults.py):
ANSWERED = "answered"  # the cache's fault, or none: every request has its normal answer
FAILED = "failed"  # the requests it touched end with a clean error, the others answered
COLD_FAILED = "cold failed"  # a prefill's: tried again where it started from reused state, a
# clean error where it started cold (the fault is then not the cache's)
OUTCOMES: dict[tuple[str, str], str] = {
    ("turn", faults.ERROR): ANSWERED,  # before the turn touches anyone
    ("admission", faults.ERROR): FAILED,
    ("lookup", faults.ERROR): ANSWERED,
    ("restore", faults.ERROR): ANSWERED,
    ("restore", faults.OOM): ANSWERED,
    ("prefill_after_restore", faults.ERROR): ANSWERED,
    ("prefill_chunk", faults.ERROR): COLD_FAILED,
    ("prefill_chunk", faults.OOM): ANSWERED,  # memory is freed and the chunk's try runs again
    ("prefill", faults.ERROR): COLD_FAILED,
    ("prefill", faults.OOM): ANSWERED,
    ("checkpoint", faults.ERROR): ANSWERED,  # one checkpoint fewer
    ("checkpoint", faults.OOM): ANSWERED,
    ("before_step", faults.ERROR): FAILED,
    ("pause", faults.ERROR): FAILED,
    ("resume", faults.ERROR): FAILED,
    ("decode", faults.ERROR): FAILED,
    ("decode", faults.OOM): FAILED,
}
CHUNKS = 9  # prefill chunks the workload runs (its three prompts, and one resumption)
# Where a fault that stays is no longer the one-off's: every try of a prefill fails, from
# reused state and cold alike; every turn fails before it touches anyone, and the engine stops.
ALWAYS_OUTCOMES = {
    ("restore", faults.OOM): FAILED,  # tried again once, then the request fails cleanly
    ("prefill_after_restore", faults.ERROR): ANSWERED,  # the cold try reaches no restore
    ("prefill_chunk", faults.ERROR): FAILED,
    ("prefill_chunk", faults.OOM): FAILED,
    ("prefill", faults.ERROR): FAILED,
    ("prefill", faults.OOM): FAILED,
}
STOPPED = "stopped"  # the engine cannot go on: every request ends with the cause
# Whom a one-off fault at these points touches, by their role: the request first in line for
# room; the paused one (the youngest); a pause, the whole batch it leaves (its state unknown).
# A decode step's touches the rows decoding at that step.
TOUCHED = {
    "admission": {"anchor"},
    "resume": {"cold"},
    "pause": {"anchor", "chain", "cold"},
}
# The faults a stored state may be blamed for (its link evicted); no other evicts anything.
BLAMING = {
    ("restore", faults.ERROR),
    ("prefill_after_restore", faults.ERROR),
    ("prefill_chunk", faults.ERROR),  # from reused state: the newest restored link
    ("prefill", faults.ERROR),
    ("disk_header", "*"),
    ("disk_read", "*"),
}


def engine_cases() -> list:
    cases = []
    for point, kinds in faults.ENGINE_POINTS.items():
        for kind in kinds:
            name = faults.fault_name(point, kind)
            each_chunk = [f"{name}@{k}" for k in range(1, CHUNKS + 1)]
            sweep = point == "prefill_chunk" and kind == faults.ERROR
            for rule in each_chunk if sweep else [f"{name}:1"]:
                cases.append(pytest.param(point, kind, rule, ONCE, id=rule))
            cases.append(pytest.param(point, kind, f"{name}:1000", ALWAYS, id=f"{name}-always"))
    return cases


def disk_cases() -> list:
    return [
        pytest.param(f"disk_{op}_{err}", how, id=f"disk_{op}_{err}-{how}")
        for op in faults.DISK_OPS
        for err in faults.OS_ERRORS
        for how in (ONCE, ALWAYS)
    ]


# -- the workload ---------------------------------------------------------------------------
def chat(prompt: list[int], boundaries: dict[int, str], answer: int = ANSWER) -> Recorder:
    params = SamplingParams(temperature=0.0, max_tokens=answer)
    return Recorder(list(prompt), params, "chat", boundaries=dict(boundaries))


def user(k: int) -> list[int]:
    return [(11 * i + 7 * k + 2) % 97 for i in range(8)]


def open_cache(directory: Path) -> PromptCache:
    return PromptCache(directory, FINGERPRINT, disk_budget=DISK_BUDGET, ram_budget=0)


def started(model, cache: PromptCache, **options) -> Engine:
    engine = Engine(
        lambda: (model, StubTokenizer()),
        prompt_cache=cache,
        prefill_step=8,
        checkpoint_interval=0,
        **options,
    )
    # A decode step between two chunks of a long prefill, however long each took: the same
    # order of work on every run (the default share follows measured seconds).
    engine.schedule = Scheduler(8, decode_share=0.0)
    engine.start()
    assert engine.ready.wait(60), engine.load_error
    return engine


class Workload:
    """The cache directory an earlier run left, and the requests of each case."""

    def __init__(self, model, root: Path) -> None:
        self.model = model
        self.root = root
        engine = started(model, open_cache(root))
        history = list(SYSTEM)
        try:
            for k in (1, 2):
                boundaries = {len(SYSTEM): "anchor"}
                if len(history) > len(SYSTEM):
                    boundaries[len(history)] = "message"
                req = chat(history + user(k), boundaries, WARM_ANSWER)
                engine.submit(req)
                assert isinstance(final(req, END_WAIT), Done)
                history = req.prompt_tokens + tokens_of(req.text)
        finally:
            engine.stop()  # closes the cache: a clean shutdown, nothing suspect
        self.history = history
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def requests(self) -> dict[str, Recorder]:
        """Shares the anchor; continues the conversation; shares nothing (a cold prefill of
        several chunks). Submitted in this order: the cold one is the youngest."""
        return {
            "anchor": chat(SYSTEM + user(3), {len(SYSTEM): "anchor"}),
            "chain": chat(
                self.history + user(4), {len(SYSTEM): "anchor", len(self.history): "message"}
            ),
            "cold": chat([(3 * i + 50) % 97 for i in range(100)], {}),
        }

    def next_request(self) -> Recorder:
        return chat(SYSTEM + user(5), {len(SYSTEM): "anchor"})

    def answer(self, prompt: list[int]) -> list[int]:
        """mlx-lm's own greedy answer (cache off, alone)."""
        key = tuple(prompt)
        if key not in self._answers:
            self._answers[key] = reference(self.model, prompt, ANSWER)
        return self._answers[key]

    def copy(self, directory: Path) -> PromptCache:
        """A fresh copy of the earlier run's cache directory, opened as a new process would.
        (File by file: `shutil.copytree` copies extended attributes with names macOS's `os`
        lacks, which the macOS-surface run removes.)"""
        directory.mkdir(mode=0o700, parents=True)
        for path in sorted(self.root.rglob("*")):
            target = directory / path.relative_to(self.root)
            if path.is_dir():
                target.mkdir(mode=0o700, parents=True)
            else:
                shutil.copyfile(path, target)
        return open_cache(directory)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Iterator[Path]:
    """Where the cache directories live: in memory where the machine has a tmpfs (/dev/shm),
    whose fsyncs cost nothing (the disk's faults are injected, not waited for)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path_factory.mktemp("fault-matrix")
        return
    root = Path(tempfile.mkdtemp(prefix="fault-matrix-", dir=shm))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def workload(model, scratch) -> Workload:
    return Workload(model, scratch / "warm")


@pytest.fixture
def kv_dir(scratch) -> Iterator[Path]:
    """A case's cache directory (not there yet), removed after the case."""
    directory = scratch / uuid.uuid4().hex
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def links_in_pieces(monkeypatch):
    monkeypatch.setattr(restore_module, "SMALL_LINK_BYTES", SMALL_LINK_BYTES)


@dataclass
class Case:
    """One case's run: the engine, its cache, the requests and how each ended, how often each
    rule's point was reached, and what the engine held once the case had settled."""

    engine: Engine
    reqs: dict[str, Recorder]
    ends: dict[str, Done | EngineError]
    reached: dict[str, int]
    held: dict | None = None  # None: the engine had stopped


def held_now(engine: Engine, cache: PromptCache) -> dict:
    """On the engine thread, after every queued disk job (`assert_disk_consistent` settles):
    what is queued, running, paused and reserved, and the cache's stats."""

    def take() -> dict:
        assert engine.room is not None
        stats = assert_disk_consistent(cache)
        waiting = (engine.queued, engine.running, engine.paused)
        return {"waiting": waiting, "holds": dict(engine.room.ledger.holds), "stats": stats}

    return engine.call(take).result(END_WAIT)


def run_case(workload: Workload, directory: Path, monkeypatch, rules: str) -> Case:
    """The three requests with `rules` armed, until every one has ended and every disk job of
    the case is done; then the rules are disarmed (the caller stops the engine)."""
    cache = workload.copy(directory)
    engine = started(workload.model, cache, kv_reserve=8, kv_budget=KV_BUDGET)
    reqs = workload.requests()
    inject_faults(monkeypatch, rules)
    try:
        submit_together(engine, list(reqs.values()))
        ends = {name: final(req, END_WAIT) for name, req in reqs.items()}
        held = held_now(engine, cache) if engine.failure is None else None
        reached = {rule: faults.reached(re.split("[:@]", rule)[0]) for rule in rules.split(",")}
    except BaseException:
        engine.stop()
        raise
    finally:
        inject_faults(monkeypatch, "")
    return Case(engine, reqs, ends, reached, held)


def check_ends(
    workload: Workload, case: Case, outcome: str, touched: set[str] | None = None
) -> None:
    """Each request's one end is its normal answer or a clean error, as `outcome` says (and
    exactly the `touched` ones fail, if known)."""
    failed = {name for name, end in case.ends.items() if isinstance(end, EngineError)}
    for name, end in case.ends.items():
        req = case.reqs[name]
        if isinstance(end, EngineError):
            assert end.message == "internal error while generating; see the server log", end
        else:
            assert end.finish_reason == "length" and end.completion_tokens == ANSWER, (name, end)
            assert tokens_of(req.text) == workload.answer(req.prompt_tokens), name
    if outcome == ANSWERED:
        assert failed == set(), case.ends
    elif outcome == FAILED:
        assert failed == touched if touched is not None else failed, case.ends
    elif outcome == COLD_FAILED:
        assert failed <= {"cold"}, case.ends  # the others started from reused state


def check_stopped(case: Case, rule: str) -> None:
    """The engine cannot go on: every request ended with the cause, new ones are refused at
    once, and nothing is left queued, running, paused or reserved."""
    point = re.split("[:@]", rule)[0]
    engine = case.engine
    for end in case.ends.values():
        assert isinstance(end, EngineError) and "engine stopped" in end.message, end
        assert f"injected fault at {point}" in end.message
    engine.join(END_WAIT)
    failure = engine.failure
    assert failure is not None and f"injected fault at {point}" in failure
    with pytest.raises(EngineNotReady, match=f"injected fault at {point}"):
        engine.submit(chat(SYSTEM + user(6), {}))  # never queued to hang
    assert (engine.queued, engine.running, engine.paused) == (0, 0, 0)
    assert engine.room is not None and engine.room.ledger.holds == {}


def check_recovered(workload: Workload, case: Case, blaming: bool) -> None:
    """Alive, nothing left waiting or reserved, the disk and the index agree (`held_now`), and
    nothing was evicted for the fault unless a stored state may be to blame; the next request
    is served."""
    engine = case.engine
    assert engine.failure is None and case.held is not None
    assert case.held["waiting"] == (0, 0, 0) and case.held["holds"] == {}
    if not blaming:
        assert case.held["stats"]["failure_evictions"] == 0, case.held["stats"]
    after = workload.next_request()
    engine.submit(after)
    end = final(after, END_WAIT)
    assert isinstance(end, Done) and end.completion_tokens == ANSWER, end
    assert tokens_of(after.text) == workload.answer(after.prompt_tokens)
    assert engine.failure is None
    engine.stop()  # the thread has ended: its ledger may be read here
    assert engine.room is not None and engine.room.ledger.holds == {}


# -- the cases -----------------------------------------------------------------------------
def test_the_workload_reaches_every_point(workload, kv_dir, monkeypatch):
    """Without a fault (every rule armed for 0 reaches): each point is reached, each prompt's
    prefill runs as planned, the youngest pauses and resumes, every answer is normal."""
    names = [faults.fault_name(p, k) for p, kinds in faults.ENGINE_POINTS.items() for k in kinds]
    names += [f"disk_{op}_{err}" for op in faults.DISK_OPS for err in faults.OS_ERRORS]
    rules = ",".join(f"{name}:0" for name in names)
    case = run_case(workload, kv_dir, monkeypatch, rules)
    try:
        check_ends(workload, case, ANSWERED)
        assert [rule for rule, count in case.reached.items() if count == 0] == []
        assert case.reached["prefill_chunk:0"] == CHUNKS
        assert case.ends["anchor"].cached_tokens == len(SYSTEM)
        assert case.ends["chain"].cached_tokens == len(workload.history) - 1  # all but the last
        assert case.ends["cold"].cached_tokens == 0
        room = case.engine.room
        assert room is not None and room.pauses == room.resumes == 1
        check_recovered(workload, case, blaming=False)
    finally:
        case.engine.stop()


@pytest.mark.parametrize(("point", "kind", "rule", "how"), engine_cases())
def test_a_fault_at_an_engine_point(workload, kv_dir, monkeypatch, point, kind, rule, how):
    outcome = OUTCOMES[(point, kind)]
    if how == ALWAYS:
        outcome = STOPPED if point == "turn" else ALWAYS_OUTCOMES.get((point, kind), outcome)
    case = run_case(workload, kv_dir, monkeypatch, rule)
    try:
        assert case.reached[rule] >= (int(rule.partition("@")[2]) if "@" in rule else 1)
        if outcome == STOPPED:
            check_stopped(case, rule)
            assert case.reached[rule] == BLAMELESS_TURNS
            return
        touched = TOUCHED.get(point) if how == ONCE else None
        check_ends(workload, case, outcome, touched)
        check_recovered(workload, case, blaming=(point, kind) in BLAMING)
    finally:
        case.engine.stop()


@pytest.mark.parametrize(("point", "how"), disk_cases())
def test_a_fault_at_the_disk(workload, kv_dir, monkeypatch, point, how):
    """The disk's faults are the cache's: every request has its normal answer."""
    rule = f"{point}:{1 if how == ONCE else 1000}"
    case = run_case(workload, kv_dir, monkeypatch, rule)
    try:
        assert case.reached[rule] >= 1, case.reached
        check_ends(workload, case, ANSWERED)
        op = point.rpartition("_")[0]
        check_recovered(workload, case, blaming=(op, "*") in BLAMING)
    finally:
        case.engine.stop()


# -- the points themselves -------------------------------------------------------------------
def test_every_engine_point_and_kind_has_an_outcome():
    declared = {(p, k) for p, kinds in faults.ENGINE_POINTS.items() for k in kinds}
    assert set(OUTCOMES) == declared
    assert set(ALWAYS_OUTCOMES) <= declared


CALL = re.compile(r"\b(maybe_fail|fires|fault_point|disk_fault|maybe_fail_disk)\(\s*\"(\w+)\"")


def test_every_point_the_package_reaches_is_declared_and_every_declared_one_is_reached():
    """Read from the source: a point called but not declared in engine/faults.py (so never in
    this matrix), or declared but called nowhere, fails."""
    called: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for function, name in CALL.findall(path.read_text()):
            called.add(f"disk:{name}" if function in ("disk_fault", "maybe_fail_disk") else name)
    declared = set(faults.ENGINE_POINTS) | set(faults.OTHER_POINTS)
    declared |= {f"disk:{op}" for op in faults.DISK_OPS}
    assert called == declared


def test_the_docstring_lists_every_point():
    doc = faults.__doc__ or ""
    names = [faults.fault_name(p, k) for p, kinds in faults.ENGINE_POINTS.items() for k in kinds]
    missing = [n for n in [*names, *faults.OTHER_POINTS] if f"`{n}`" not in doc]
    assert missing == []
