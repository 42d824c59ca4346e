#!/usr/bin/env python3
"""Decode speed with a draft model as a speculation source, beside the lookup sources
(docs/speculation.md, "A draft model").

    python scripts/bench_draft_model.py                    # 3 runs per cell
    python scripts/bench_draft_model.py --reps 5 --draft-layers 6,30

Servers of the default model (SmolLM2-135M) in one run, each asked the same greedy requests:
`--speculation off`, `auto` (prompt lookup and the prompt cache's continuations), and `auto`
with a draft model per `--draft-layers` value N: the default model's own first N of its 30
layers (its final norm and tied output head kept), written to a temporary directory, a draft of
the same tokenizer and family without training (30: the model itself, every draft right, the
ceiling of acceptance and the full cost of drafting with a model as large as the target).
There is no smaller SmolLM2 offline; on a Mac a real pair (Qwen3-0.6B for Qwen3-8B) is the
case to measure. The cells are bench_speculation.py's, one request at a time (the servers'
own decode tokens/s, their log lines), and four prose requests at once (tokens/s over the
four, timed by the client: the draft model's batched passes). Texts of every server are
compared (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _bench_common import (  # noqa: E402
    Server,
    add_run_options,
    load_average,
    machine,
    model_dir,
    set_blas_threads,
    workdir,
)
from bench_speculation import TOPICS, ask, cells, warm_up  # noqa: E402

TRUNCATE = """
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
source, dest, layers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dest.mkdir(parents=True)
weights = mx.load(str(source / "model.safetensors"))
keep = {k: v for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
mx.save_safetensors(str(dest / "model.safetensors"), keep, metadata={"format": "mlx"})
config = json.loads((source / "config.json").read_text())
(dest / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (source / name).is_file():
        shutil.copyfile(source / name, dest / name)
"""


def truncated(dest: Path, layers: int) -> Path:
    """The default model's first `layers` layers as a model directory of its own."""
    subprocess.run([sys.executable, "-c", TRUNCATE, str(model_dir()), str(dest), str(layers)])
    return dest


def draft_counts(server: Server) -> tuple[float, float]:
    """(drafted, kept) by the draft model so far, from /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    out = []
    for name in ("drafted", "accepted"):
        pattern = rf'^mlx_kvserve_speculation_{name}_tokens_total\{{source="draft_model"\}} (\S+)$'
        out.append(float(re.findall(pattern, text, re.M)[0]))
    return out[0], out[1]


def at_once(server: Server, rep: int, max_tokens: int, rows: int = 4) -> tuple[float, list[str]]:
    """`rows` prose requests sent together: their completion tokens over the wall time."""
    texts, tokens = [""] * rows, [0] * rows

    def one(i: int) -> None:
        topic = TOPICS[(rep * rows + i) % len(TOPICS)]
        body = {
            "model": "default",
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Describe {topic} in a few sentences."}],
        }
        reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1800)
        texts[i] = reply.json()["choices"][0]["message"]["content"]
        tokens[i] = reply.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(rows)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    server.new_log_lines()  # read past their lines
    return sum(tokens) / seconds, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument(
        "--draft-layers",
        default="8,30",
        help="comma-separated: a server with a draft model of the default model's first N layers",
    )
    parser.add_argument("--cells", default="", help="only the cells whose name contains this")
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    layers = [int(n) for n in args.draft_layers.split(",") if n]
    with workdir(args.keep) as tmp:
        modes: dict[str, list[str]] = {"off": ["--speculation", "off"], "auto": []}
        modes["auto"] = ["--speculation", "auto"]
        for n in layers:
            draft = truncated(tmp / f"draft-{n}", n)
            modes[f"draft{n}"] = ["--speculation", "auto", "--draft-model", str(draft)]
        servers = {}
        for mode, extra in modes.items():
            (tmp / mode).mkdir()
            servers[mode] = Server(
                "kvserve", tmp / mode, cache_dir=tmp / mode / "cache", extra=extra
            )
            servers[mode].start()
        print(f"# {machine()}; load average before: {load_average()}")
        print(f"# median decode tok/s of {args.reps} greedy runs, {args.max_tokens} tokens at most")
        print("# draftN: auto with a draft model of the default model's first N of 30 layers")
        wanted = [n for n in [*cells(0), "4 prose at once (chat)"] if args.cells in n]
        for server in servers.values() if "loop" in " ".join(wanted) else ():
            for route, body in warm_up():  # the recorded loop's first pass, untimed
                ask(server, route, body, args.max_tokens)
        names = list(servers)
        head = f"{'cell':26s} " + " ".join(f"{m:>7s}" for m in names)
        print(f"{head}  " + "  ".join(f"{m} kept/drafted" for m in names if m.startswith("draft")))
        for name in wanted:
            speeds: dict[str, list[float]] = {m: [] for m in names}
            texts: dict[str, list] = {m: [] for m in names}
            before = {m: draft_counts(s) for m, s in servers.items() if m.startswith("draft")}
            for rep in range(args.reps):
                for mode, server in servers.items():
                    if name.startswith("4 prose"):
                        tps, out = at_once(server, rep, args.max_tokens)
                        speeds[mode].append(tps)
                        texts[mode].append(out)
                        continue
                    for route, body in cells(rep)[name]:
                        text, figures = ask(server, route, body, args.max_tokens)
                        speeds[mode].append(figures["tps"])
                        texts[mode].append(text)
            medians = {m: statistics.median(v) for m, v in speeds.items()}
            row = f"{name:26s} " + " ".join(f"{medians[m]:7.1f}" for m in names)
            for mode, (drafted, kept) in before.items():
                now = draft_counts(servers[mode])
                row += f"  {now[1] - kept:>6.0f}/{now[0] - drafted:<8.0f}"
            same = all(texts[m] == texts["off"] for m in names)
            print(f"{row}  {'same' if same else 'DIFFERENT'}", flush=True)
        print(f"# load average after: {load_average()}")


if __name__ == "__main__":
    main()
