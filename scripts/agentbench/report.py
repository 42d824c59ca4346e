"""Figures from the calls (pure functions), the markdown tables, the JSON file and the plots.

Definitions (the same for both servers, and unchanged once requests run in batches):
* prefilled = prompt_tokens - cached_tokens, from each server's own usage;
* TTFT: from sending the request to the first non-empty content chunk of the stream;
* aggregate decode tok/s: sum of (completion_tokens - 1) over the time during which at least
  one request was decoding (the union of the first-to-last-token intervals);
* wall: the time during which at least one request was in flight (restarts excluded).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentbench.side import Call, DiskHit
from agentbench.workloads import Result

MiB = 2**20


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(calls: list[Call]) -> dict[str, Any]:
    """The per-server figures of one workload."""
    ttfts = [c.ttft for c in calls]
    decoding = [(c.t_first, c.t_last) for c in calls if c.t_first is not None and c.t_last]
    busy = union_length(decoding)  # type: ignore[arg-type]
    steps = sum(max(c.completion - 1, 0) for c in calls)
    return {
        "requests": len(calls),
        "prompt_tokens": sum(c.prompt for c in calls),
        "prefilled": sum(c.prefilled for c in calls),
        "completion_tokens": sum(c.completion for c in calls),
        "ttft_median": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_max": max(ttfts, default=float("nan")),
        "decode_tps": steps / busy if busy > 0 else float("nan"),
        "wall": union_length([(c.t_send, c.t_end) for c in calls]),
    }


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer else float("nan")


def _x(r: float) -> str:
    return "-" if r != r else f"{r:.2f}x"  # noqa: PLR0124 - NaN check


def _table(head: list[str], rows: list[list[Any]], align: str = "") -> str:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def workload_tables(results: list[Result]) -> str:
    rows, ratios = [], []
    for r in results:
        s = {k: summarise(v) for k, v in r.calls.items()}
        for name in ("ours", "peer"):
            f = s[name]
            extra = ["-", "-"]
            if name == "ours":
                extra = [
                    f"{r.bytes_written / MiB:.1f} MiB",
                    f"{r.footprint.get('disk_bytes', 0) / MiB:.1f} MiB",
                ]
            rows.append(
                [r.name, name, f["requests"], f["prompt_tokens"], f["prefilled"],
                 f"{f['ttft_median']:.2f} s", f"{f['ttft_max']:.2f} s",
                 f"{f['decode_tps']:.1f}", f"{f['wall']:.1f} s", *extra]
            )  # fmt: skip
        o, p = s["ours"], s["peer"]
        ratios.append(
            [r.name, _x(ratio(o["prefilled"], p["prefilled"])),
             _x(ratio(o["ttft_median"], p["ttft_median"])), _x(ratio(o["ttft_max"], p["ttft_max"])),
             _x(ratio(o["decode_tps"], p["decode_tps"])), _x(ratio(o["wall"], p["wall"]))]
        )  # fmt: skip
    head = ["workload", "server", "requests", "prompt tokens", "prefilled", "TTFT median",
            "TTFT max", "decode tok/s", "wall", "bytes written", "final footprint"]  # fmt: skip
    rhead = ["workload", "prefilled", "TTFT median", "TTFT max", "decode tok/s", "wall"]
    return (
        "## Per workload and server\n\n" + _table(head, rows, "ll" + "r" * 9)
        + "\n\n## Ratios ours / peer (below 1 is better for ours, except decode tok/s)\n\n"
        + _table(rhead, ratios)
    )  # fmt: skip


def turn_table(result: Result) -> str:
    rows = []
    for o, p in zip(result.calls["ours"], result.calls["peer"], strict=False):
        rows.append(
            [o.turn, o.event, o.prompt, o.cached, o.source or "?", f"{o.ttft:.2f} s",
             p.prompt, p.cached, f"{p.ttft:.2f} s", _x(ratio(o.ttft, p.ttft))]
        )  # fmt: skip
    head = ["turn", "event", "ours prompt", "ours cached", "ours source", "ours TTFT",
            "peer prompt", "peer cached", "peer TTFT", "TTFT ours/peer"]  # fmt: skip
    return f"## {result.name}: per turn\n\n" + _table(head, rows, "rlrrlrrrrr")


def disk_table(hits: list[DiskHit]) -> str:
    rows = [
        [h.workload, h.turn, h.tokens, f"{h.bytes / MiB:.1f} MiB", h.files,
         f"{h.restore_s:.3f} s", f"{h.cold_read_s:.3f} s", _x(ratio(h.restore_s, h.cold_read_s)),
         f"{h.warm_read_s:.3f} s", f"{h.bytes / MiB / h.cold_read_s:.0f} MiB/s"
         if h.cold_read_s else "-"]
        for h in hits
    ]  # fmt: skip
    head = ["workload", "turn", "cached tokens", "bytes read", "files", "restore",
            "plain read (cold)", "restore / cold read", "plain read (warm)",
            "cold read bandwidth"]  # fmt: skip
    evict = ", ".join(sorted({h.evict for h in hits})) or "-"
    return (
        f"## Disk hits (ours): restore vs a plain read of the same files (page cache dropped "
        f"by {evict})\n\n" + _table(head, rows, "l" + "r" * 9)
    )


def sweep_summary(sweep: dict[str, dict[int, list[Call]]]) -> list[dict[str, Any]]:
    out = []
    for n in sorted(sweep.get("ours", {})):
        o, p = summarise(sweep["ours"][n]), summarise(sweep.get("peer", {}).get(n, []))
        out.append({"agents": n, "ours": o, "peer": p})
    return out


def sweep_table(rows: list[dict[str, Any]]) -> str:
    body = [
        [r["agents"], f"{r['ours']['decode_tps']:.1f}", f"{r['peer']['decode_tps']:.1f}",
         _x(ratio(r["ours"]["decode_tps"], r["peer"]["decode_tps"])),
         f"{r['ours']['ttft_median']:.2f} s", f"{r['peer']['ttft_median']:.2f} s",
         f"{r['ours']['wall']:.1f} s", f"{r['peer']['wall']:.1f} s"]
        for r in rows
    ]  # fmt: skip
    head = ["concurrent agents", "ours decode tok/s", "peer decode tok/s", "ours/peer",
            "ours TTFT median", "peer TTFT median", "ours wall", "peer wall"]  # fmt: skip
    return "## Throughput sweep: aggregate decode tok/s vs concurrent agents\n\n" + _table(
        head, body
    )


def targets(results: list[Result], hits: list[DiskHit], rows: list[dict[str, Any]]) -> str:
    """Issue 12's targets that this benchmark measures, as ratios from this run."""
    by = {r.name: {k: summarise(v) for k, v in r.calls.items()} for r in results}
    out = []
    a = by.get("agents at once")
    solo = next((r["ours"]["decode_tps"] for r in rows if r["agents"] == 1), float("nan"))
    if a:
        o, p = a["ours"], a["peer"]
        out += [
            ["4 agents: decode tok/s, ours / ours one at a time (sweep, 1 agent)", ">= 2.5x",
             _x(ratio(o["decode_tps"], solo))],
            ["4 agents: decode tok/s, ours / peer", ">= 1x", _x(ratio(o["decode_tps"],
                                                                     p["decode_tps"]))],
            ["4 agents: median TTFT, peer / ours", ">= 3x", _x(ratio(p["ttft_median"],
                                                                     o["ttft_median"]))],
        ]  # fmt: skip
    s = by.get("agent session")
    if s:
        o, p = s["ours"], s["peer"]
        out += [
            ["agent session: prefilled tokens, ours / peer", "<= 0.2x",
             _x(ratio(o["prefilled"], p["prefilled"]))],
            ["agent session: median TTFT, peer / ours", ">= 5x",
             _x(ratio(p["ttft_median"], o["ttft_median"]))],
        ]  # fmt: skip
    r = next((x for x in results if x.name == "resident sessions"), None)
    if r:

        def median_ttft(event: str) -> float:
            return statistics.median([c.ttft for c in r.calls["ours"] if c.event == event])

        back = ratio(median_ttft("return"), median_ttft("continue"))
        out.append(["resident conversation: median TTFT, return / continue", "<= 1.2x", _x(back)])
    if hits:
        worst = max(ratio(h.restore_s, h.cold_read_s) for h in hits)
        out.append(["disk-hit restore / cold plain read (worst hit)", "<= 2x", _x(worst)])
    return "## Issue 12's targets, measured\n\n" + _table(["target", "goal", "this run"], out)


def load_json(path: Path) -> tuple[dict, list[Result], list[DiskHit], list[dict[str, Any]]]:
    """What `write_json` wrote, back as objects and sweep rows (to print and plot again)."""
    data = json.loads(path.read_text())
    results = []
    for w in data.get("workloads", []):
        r = Result(w["name"], bytes_written=w["ours_bytes_written"], footprint=w["ours_footprint"],
                   sources=w["ours_cache_sources"], restart_s=w["restart_seconds"])  # fmt: skip
        r.calls = {k: [Call(**c) for c in v] for k, v in w["calls"].items()}
        results.append(r)
    hits = [DiskHit(**h) for h in data.get("disk_hits", [])]
    meta = {k: v for k, v in data.items() if k not in ("workloads", "disk_hits", "sweep")}
    meta.pop("sweep_calls", None)
    return meta, results, hits, data.get("sweep", [])


def write_json(path: Path, meta: dict, results: list[Result], hits: list[DiskHit],
               sweep: dict[str, dict[int, list[Call]]]) -> None:  # fmt: skip
    data = {
        **meta,
        "workloads": [
            {
                "name": r.name,
                "summary": {k: summarise(v) for k, v in r.calls.items()},
                "ours_bytes_written": r.bytes_written,
                "ours_footprint": r.footprint,
                "ours_cache_sources": r.sources,
                "restart_seconds": r.restart_s,
                "calls": {k: [asdict(c) for c in v] for k, v in r.calls.items()},
            }
            for r in results
        ],
        "disk_hits": [asdict(h) for h in hits],
        "sweep": sweep_summary(sweep),
        "sweep_calls": {k: {n: [asdict(c) for c in v] for n, v in per.items()}
                        for k, per in sweep.items()},
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def plots(out: Path, session: Result | None, hits: list[DiskHit], rows: list[dict]) -> list[Path]:
    """PNG plots with matplotlib (an optional extra: `pip install .[bench]`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    made = []
    if session is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, style in (("ours", "o-"), ("peer", "s--")):
            calls = session.calls[name]
            ax.plot([c.turn for c in calls], [c.ttft for c in calls], style, label=_label(name))
        for c in session.calls["ours"]:
            if c.event:
                ax.axvline(c.turn, color="grey", lw=0.8, ls=":")
                ax.annotate(c.event, (c.turn, 0.03), xycoords=("data", "axes fraction"),
                            rotation=90, va="bottom", ha="right", fontsize=8)  # fmt: skip
        ax.set(yscale="log", xlabel="turn", ylabel="time to first token (s)",
               title="Agent session: TTFT per turn")  # fmt: skip
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        made.append(_save(fig, out / "agents-bench-ttft.png"))
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["agents"] for r in rows]
        for name, style in (("ours", "o-"), ("peer", "s--")):
            ax.plot(xs, [r[name]["decode_tps"] for r in rows], style, label=_label(name))
        ax.set(xlabel="concurrent agents", ylabel="aggregate decode tokens/s", ylim=(0, None),
               title="Throughput vs concurrent agents")  # fmt: skip
        ax.legend()
        made.append(_save(fig, out / "agents-bench-throughput.png"))
    if hits:
        fig, ax = plt.subplots(figsize=(7, 4))
        size = [h.bytes / MiB for h in hits]
        ax.plot(size, [h.restore_s for h in hits], "o", label="mlx-kvserve disk restore")
        ax.plot(size, [h.cold_read_s for h in hits], "x", label="plain read, cold")
        bw = statistics.median(h.bytes / MiB / h.cold_read_s for h in hits if h.cold_read_s)
        top = max(size) * 1.1
        ax.plot([0, top], [0, top / bw], "-", color="grey", label=f"read bandwidth {bw:.0f} MiB/s")
        ax.set(xlabel="checkpoint bytes read (MiB)", ylabel="seconds", xlim=(0, top),
               ylim=(0, None), title="Restore time vs checkpoint size")  # fmt: skip
        ax.legend()
        made.append(_save(fig, out / "agents-bench-restore.png"))
    return made


def _label(name: str) -> str:
    return "mlx-kvserve" if name == "ours" else "mlx_lm.server"


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
