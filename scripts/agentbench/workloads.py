"""The workloads, each run against both servers on a fresh pair of processes (ours with an empty
cache directory of its own, so that bytes written and footprint are the workload's).

Sequential workloads (the agent session, the shared system prompt, the long prompt twice) send
each request to ours, then the same request to the peer, turn by turn, and restart both servers
at the same point; every agent keeps its own server's answers in its history. Concurrent
workloads (4 agents at once, the throughput sweep) run on one server at a time, so that the two
never compete for the CPU. Prompt text comes from a fixed seed.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import _bench_common as bc
from replay_agent import summary, tool_block, tool_output

from agentbench.side import Call, DiskHit, Side

TASK = (
    "Task: the retry policy ignores the configured timeout. Find out why and fix it. Start by "
    "listing the repository."
)


@dataclass
class Sizes:
    """How big each workload is (the full run's defaults; `quick()` for a smoke run)."""

    turns: int = 20
    system_tokens: int = 1000
    tool_tokens: int = 150
    max_tokens: int = 16
    agents: int = 4
    agent_context: int = 2000
    agent_turns: int = 6
    agent_message: int = 60
    shared_system: int = 1500
    shared_convs: int = 4
    shared_turns: int = 2
    long_sizes: tuple[int, ...] = (1000, 2000, 3000)
    sweep: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    sweep_tokens: int = 32
    resident_context: int = 1500
    resident_rounds: int = 3

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            turns=6, system_tokens=200, tool_tokens=60, max_tokens=8, agent_context=250,
            agent_turns=2, agent_message=30, shared_system=300, shared_convs=3, shared_turns=1,
            long_sizes=(300, 600), sweep=(1, 2, 4), sweep_tokens=8, resident_context=250,
            resident_rounds=1,
        )  # fmt: skip


@dataclass
class Result:
    """One workload's calls per server, and what ours reported about its cache."""

    name: str
    calls: dict[str, list[Call]] = field(default_factory=lambda: {"ours": [], "peer": []})
    bytes_written: int = 0
    footprint: dict[str, int] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # ours' cache sources, all requests
    restart_s: dict[str, list[float]] = field(default_factory=dict)


def next_turn(reply: str, new: dict) -> list[dict]:
    """The assistant's reply and the next message. A tool result is sent as a user message
    headed `[result of <tool>]`: both servers then see the same tokens (the default model's
    template has no tool syntax, and mlx_lm.server's rendering would drop the calls)."""
    return [{"role": "assistant", "content": reply}, {**new, "role": "user"}]


@contextlib.contextmanager
def fresh(work: Path, name: str, step: int, kinds: tuple[str, ...]) -> Iterator[list[Side]]:
    """Start the servers of `kinds` in `work/name` (ours first: it converts the default model
    on first use, which the peer then loads); stop them afterwards."""
    sides = [Side(kind, work / name, step) for kind in kinds]
    (work / name).mkdir(parents=True, exist_ok=True)
    try:
        for side in sides:
            side.start()
        yield sides
    finally:
        for side in sides:
            side.stop()


def _send(side: Side, res: Result, messages: list[dict], sz: Sizes, turn: int,
          hits: list[DiskHit], **fields: object) -> Call:  # fmt: skip
    """One request of a sequential workload, recorded in `res` with `fields` set on it."""
    call = side.chat_probed(
        messages, max_tokens=sz.max_tokens, workload=res.name, turn=turn, hits=hits
    )
    for name, value in fields.items():
        setattr(call, name, value)
    res.calls[side.name].append(call)
    return call


def _finish(result: Result, sides: list[Side]) -> None:
    for side in sides:
        result.restart_s[side.name] = side.restart_s
        if side.ours:
            result.bytes_written = side.bytes_written()
            result.footprint = side.footprint()
            result.sources += side.engine_sources()


# ============================================================ sequential workloads ========
def agent_session(
    work: Path, step: int, sz: Sizes, tok: bc.Tokens, hits: list[DiskHit], seed: int = 0
) -> Result:
    """`sz.turns` turns of growing context with tool results; the history is replaced by a
    summary at the middle turn, and both servers restart before the turn at 70%."""
    res = Result("agent session")
    rng = random.Random(seed)
    system = {"role": "system", "content": tool_block(rng, tok, sz.system_tokens)}
    summarise_at, restart_at = max(2, sz.turns // 2), max(3, round(sz.turns * 0.7))
    with fresh(work, "session", step, ("kvserve", "mlx_lm")) as sides:
        history = {s.name: [{"role": "user", "content": TASK}] for s in sides}
        last: dict[str, str] = {}
        for n in range(1, sz.turns + 1):
            event = ""
            if n == restart_at:
                for side in sides:
                    side.restart()
                event = "after restart"
            if n == summarise_at:
                event = "summarised history"
                short = summary(rng, n)
            new = tool_output(rng, tok, n, sz.tool_tokens) if n > 1 else None
            for side in sides:
                h = history[side.name]
                if n == summarise_at:
                    h[:] = [short]
                if new:
                    h += next_turn(last[side.name], new)
                last[side.name] = _send(side, res, [system, *h], sz, n, hits, event=event).text
            _progress(res.name, n, res.calls)
        _finish(res, sides)
    return res


def shared_system(
    work: Path, step: int, sz: Sizes, tok: bc.Tokens, hits: list[DiskHit], seed: int = 1
) -> Result:
    """`sz.shared_convs` conversations over one long system prompt, `sz.shared_turns` turns
    each, the conversations taking turns."""
    res = Result("shared system prompt")
    rng = random.Random(seed)
    system = {"role": "system", "content": tool_block(rng, tok, sz.shared_system)}
    with fresh(work, "shared", step, ("kvserve", "mlx_lm")) as sides:
        convs = {
            s.name: [[{"role": "user", "content": f"Conversation {c + 1}. {TASK}"}] for c in
                     range(sz.shared_convs)]
            for s in sides
        }  # fmt: skip
        last: dict[tuple[str, int], str] = {}
        n = 0
        for t in range(1, sz.shared_turns + 1):
            for c in range(sz.shared_convs):
                n += 1
                new = tool_output(rng, tok, t + c, sz.agent_message) if t > 1 else None
                for side in sides:
                    h = convs[side.name][c]
                    if new:
                        h += next_turn(last[side.name, c], new)
                    last[side.name, c] = _send(side, res, [system, *h], sz, n, hits, agent=c).text
                _progress(res.name, n, res.calls)
        _finish(res, sides)
    return res


def long_twice(
    work: Path, step: int, sz: Sizes, tok: bc.Tokens, hits: list[DiskHit], seed: int = 2
) -> Result:
    """Long prompts of `sz.long_sizes` tokens, each sent once, both servers restarted, then
    each sent again (ours restores it from disk; the peer's RAM cache died with it)."""
    res = Result("long prompt twice")
    prompts = []
    for i, n in enumerate(sz.long_sizes):
        body = tok.fit(bc.varied_chunks(random.Random(seed * 1000 + i)), max(n - 40, 16))
        prompts.append(
            [
                {"role": "system", "content": f"Project notes, volume {i + 1}.\n\n{body}"},
                {"role": "user", "content": "Summarise these notes in one sentence."},
            ]
        )
    with fresh(work, "long", step, ("kvserve", "mlx_lm")) as sides:
        turn = 0
        for event in ("first", "after restart"):
            if event != "first":
                for side in sides:
                    side.restart()
            for messages in prompts:
                turn += 1
                for side in sides:
                    _send(side, res, messages, sz, turn, hits, event=event)
                _progress(res.name, turn, res.calls)
        _finish(res, sides)
    return res


def resident(
    work: Path, step: int, sz: Sizes, tok: bc.Tokens, hits: list[DiskHit], seed: int = 4
) -> Result:
    """Two conversations with their own ~`sz.resident_context`-token contexts, alternating in
    pairs of turns (A, A, B, B, ...): the first of each pair returns to a conversation that was
    left for the other one (`event="return"`), the second continues the one just served
    (`event="continue"`). Ours keeps both live (resident sessions), so the two should cost the
    same."""
    res = Result("resident sessions")
    rng = random.Random(seed)
    with fresh(work, "resident", step, ("kvserve", "mlx_lm")) as sides:
        convs = {
            s.name: [
                [
                    {"role": "system", "content": f"Conversation {c + 1}'s notes.\n\n"
                     + tok.fit(bc.varied_chunks(random.Random(seed * 10 + c)),
                               sz.resident_context)},
                    {"role": "user", "content": TASK},
                ]
                for c in range(2)
            ]
            for s in sides
        }  # fmt: skip
        last: dict[tuple[str, int], str] = {}
        plan = [(0, "first"), (1, "first")]
        for _ in range(sz.resident_rounds):
            plan += [(0, "return"), (0, "continue"), (1, "return"), (1, "continue")]
        for n, (c, event) in enumerate(plan, start=1):
            new = tool_output(rng, tok, n, sz.agent_message) if event != "first" else None
            for side in sides:
                h = convs[side.name][c]
                if new:
                    h += next_turn(last[side.name, c], new)
                call = _send(side, res, h, sz, n, hits, agent=c, event=event)
                last[side.name, c] = call.text
            _progress(res.name, n, res.calls)
        _finish(res, sides)
    return res


# ============================================================ concurrent workloads ========
def _threads(n: int, body: Callable[[int], None]) -> None:
    """Run body(0..n-1) on n threads that start together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            body(i)
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def agents_at_once(work: Path, step: int, sz: Sizes, tok: bc.Tokens, seed: int = 3) -> Result:
    """`sz.agents` agents, each with its own ~`sz.agent_context`-token context, `sz.agent_turns`
    turns each, all sent concurrently (one thread an agent)."""
    res = Result("agents at once")
    contexts = [
        tok.fit(bc.varied_chunks(random.Random(seed * 100 + i)), sz.agent_context)
        for i in range(sz.agents)
    ]
    lock = threading.Lock()
    for kind in ("kvserve", "mlx_lm"):
        with fresh(work, f"agents-{kind}", step, (kind,)) as (side,):

            def agent(i: int, side: Side = side) -> None:
                rng = random.Random(seed * 100 + 50 + i)
                msgs = [
                    {"role": "system", "content": f"Agent {i + 1}'s notes.\n\n{contexts[i]}"},
                    {"role": "user", "content": TASK},
                ]
                for t in range(1, sz.agent_turns + 1):
                    call = side.chat(msgs, max_tokens=sz.max_tokens, agent=i, turn=t)
                    with lock:
                        res.calls[side.name].append(call)
                    msgs += next_turn(call.text, tool_output(rng, tok, t + 1, sz.agent_message))

            _threads(sz.agents, agent)
            print(f"  {res.name}: {side.name} done ({len(res.calls[side.name])} calls)")
            _finish(res, [side])
    return res


def sweep(work: Path, step: int, sz: Sizes) -> dict[str, dict[int, list[Call]]]:
    """Aggregate decode throughput against the number of concurrent agents: n agents each
    ask for `sz.sweep_tokens` tokens of a long answer at once, for n in `sz.sweep`."""
    out: dict[str, dict[int, list[Call]]] = {}
    for kind in ("kvserve", "mlx_lm"):
        with fresh(work, f"sweep-{kind}", step, (kind,)) as (side,):
            out[side.name] = {}
            for n in sz.sweep:
                calls: list[Call] = []

                def one(i: int, side: Side = side, calls: list[Call] = calls) -> None:
                    msg = f"Agent {i + 1}: count from 1 to 500, separated by commas."
                    c = side.chat([{"role": "user", "content": msg}], max_tokens=sz.sweep_tokens)
                    c.agent = i
                    calls.append(c)

                _threads(n, one)
                out[side.name][n] = calls
                print(f"  sweep: {side.name} n={n} done", flush=True)
    return out


def _progress(name: str, n: int, calls: dict[str, list[Call]]) -> None:
    cells = []
    for side, cs in calls.items():
        if cs:
            c = cs[-1]
            src = f" {c.source}" if c.source else ""
            cells.append(f"{side}: {c.prompt}/{c.cached} ttft={c.ttft:.2f}s{src}")
    print(f"  {name} #{n}: " + "; ".join(cells), flush=True)
