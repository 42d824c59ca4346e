"""The pure helpers of scripts/bench_agents.py: interval unions, per-server figures, the
Prometheus parser, plain reads and the tables (no servers, no timings asserted)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

pytest.importorskip("openai")
_sigterm = signal.getsignal(signal.SIGTERM)

from agentbench import report  # noqa: E402
from agentbench.side import Call, DiskHit, parse_prometheus, plain_read  # noqa: E402
from agentbench.workloads import Result, Sizes, next_turn  # noqa: E402

signal.signal(signal.SIGTERM, _sigterm)  # _bench_common installs its own handler on import


def _call(server: str, send: float, first: float, last: float, end: float, **kw) -> Call:
    base = {"agent": 0, "turn": 1, "prompt": 100, "cached": 40, "completion": 5}
    return Call(server=server, t_send=send, t_first=first, t_last=last, t_end=end, **base | kw)


def test_union_length_counts_overlaps_once():
    assert report.union_length([]) == 0
    assert report.union_length([(0, 1), (2, 3)]) == 2
    assert report.union_length([(0, 2), (1, 3), (1.5, 2.5)]) == 3
    assert report.union_length([(0, 4), (1, 2)]) == 4


def test_summarise_figures():
    calls = [_call("ours", 0, 1, 3, 3), _call("ours", 0, 2, 4, 4.5, cached=100, completion=1)]
    s = report.summarise(calls)
    assert s["prefilled"] == 60
    assert s["ttft_median"] == 1.5 and s["ttft_max"] == 2
    assert s["decode_tps"] == pytest.approx(4 / 3)  # 4 steps over the union [1, 4]
    assert s["wall"] == 4.5
    assert s["requests"] == 2 and s["completion_tokens"] == 6


def test_call_without_content_times_to_end():
    c = _call("peer", 1, None, None, 3, completion=0)
    assert c.ttft == 2
    assert report.summarise([c])["decode_tps"] != report.summarise([c])["decode_tps"]  # NaN


def test_parse_prometheus():
    text = (
        "# HELP x y\n# TYPE x histogram\n"
        'mlx_kvserve_cache_restore_seconds_sum{tier="disk"} 0.25\n'
        'mlx_kvserve_cache_restore_seconds_count{tier="disk"} 2.0\n'
        "mlx_kvserve_cache_written_bytes_total 1.5e+06\n"
        "garbage line\n"
    )
    m = parse_prometheus(text)
    assert m['mlx_kvserve_cache_restore_seconds_sum{tier="disk"}'] == 0.25
    assert m['mlx_kvserve_cache_restore_seconds_count{tier="disk"}'] == 2
    assert m["mlx_kvserve_cache_written_bytes_total"] == 1.5e6
    assert "garbage" not in m


def test_plain_read_reads_every_file(tmp_path):
    paths = []
    for i, n in enumerate((10, 5000, 0)):
        p = tmp_path / f"{i}.kvc"
        p.write_bytes(b"x" * n)
        paths.append(p)
    assert plain_read(paths) >= 0


def test_next_turn_sends_tool_results_as_user_messages():
    out = next_turn("ok", {"role": "tool", "content": "[result of grep]\nx"})
    assert out == [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "[result of grep]\nx"},
    ]


def test_tables_render():
    r = Result("agent session")
    r.calls["ours"] = [_call("ours", 0, 0.5, 1, 1, event="after restart", source="disk")]
    r.calls["peer"] = [_call("peer", 2, 3, 4, 4, cached=0)]
    text = report.workload_tables([r])
    assert "| agent session | ours | 1 | 100 | 60 |" in text
    assert "0.60x" in text  # prefilled 60 / 100
    assert "after restart" in report.turn_table(r)
    hit = DiskHit("agent session", 1, 40, 2**20, 2, 0.02, 0.01, 0.001, "fadvise DONTNEED")
    assert "2.00x" in report.disk_table([hit])
    rows = report.sweep_summary({"ours": {1: r.calls["ours"]}, "peer": {1: r.calls["peer"]}})
    assert rows[0]["agents"] == 1
    assert "| 1 |" in report.sweep_table(rows)


def test_quick_sizes_are_smaller():
    full, quick = Sizes(), Sizes.quick()
    assert quick.turns < full.turns and max(quick.long_sizes) < max(full.long_sizes)
    assert full.sweep == tuple(range(1, 9)) and full.agents == 4


def test_json_round_trip(tmp_path):
    r = Result("agent session", bytes_written=10, footprint={"disk_bytes": 5})
    r.calls["ours"] = [_call("ours", 0, 0.5, 1, 1, event="after restart", source="disk")]
    r.calls["peer"] = [_call("peer", 2, 3, 4, 4, cached=0)]
    hit = DiskHit("agent session", 1, 40, 2**20, 2, 0.02, 0.01, 0.001, "drop_caches")
    sweep = {"ours": {1: r.calls["ours"]}, "peer": {1: r.calls["peer"]}}
    path = tmp_path / "out.json"
    report.write_json(path, {"command": "x"}, [r], [hit], sweep)
    meta, results, hits, rows = report.load_json(path)
    assert meta["command"] == "x" and hits == [hit]
    assert results[0].calls == r.calls and results[0].bytes_written == 10
    assert rows[0]["agents"] == 1
    assert "agent session" in report.targets(results, hits, rows)
