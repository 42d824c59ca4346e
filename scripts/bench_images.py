#!/usr/bin/env python3
"""What an image costs a request on a model that does not see images (docs/images.md).

    python scripts/bench_images.py               # decode table, then the servers, 3 rounds
    python scripts/bench_images.py --decode-only

1. Decoding, in this process: a screenshot-like PNG and a JPEG at three sizes, read the way a
   request's data URL is (base64, format sniffing, the caps, every pixel decoded, the pixel
   digest), the first time and when the same bytes come again (the next turn of the
   conversation: the reader kept it); the median over rounds.
2. The turn after a screenshot, on two servers of the default model, one with the prompt
   cache and one with `--no-cache`: turn 1 is a long system prompt and a user turn with a
   2560x1600 screenshot (shown to the model as its note); turn 2 adds the answer and a
   question. Each round uses a fresh system prompt (no round finds another's prefix); the
   table has the median time to first token of turn 2 and its cached tokens.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import Reply, Server, chat, http_client, machine, workdir  # noqa: E402

SIZES = [(1280, 800), (2560, 1600), (3840, 2160)]


def screenshot(width: int, height: int, fmt: str) -> bytes:
    """Flat panels, bars and text, as a desktop screenshot is (PNG compresses it well)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (246, 246, 248))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 40), fill=(32, 34, 44))
    draw.rectangle((0, 40, width // 5, height), fill=(230, 232, 238))
    for row in range(60, height - 20, 22):
        for col in range(width // 5 + 20, width - 200, 260):
            draw.text((col, row), f"line {row} col {col} lorem ipsum", fill=(20, 20, 20))
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return out.getvalue()


def decode_table(rounds: int) -> None:
    from mlx_kvserve.images.reader import ImageReader

    print("| image | encoded | first time: decode + digest | sent again |")
    print("|---|---:|---:|---:|")
    for width, height in SIZES:
        for fmt in ("PNG", "JPEG"):
            data = screenshot(width, height, fmt)
            url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
            first, again = [], []
            for _ in range(rounds):
                reader = ImageReader()  # a new one: nothing seen yet
                for times in (first, again):
                    start = time.perf_counter()
                    reader.from_url(url, "bench")
                    times.append(time.perf_counter() - start)
            ms = [statistics.median(times) * 1000 for times in (first, again)]
            size = f"{len(data) / 1024:.0f} KiB"
            print(f"| {fmt} {width}x{height} | {size} | {ms[0]:.1f} ms | {ms[1]:.1f} ms |")


def turn_two(rounds: int, root: Path) -> None:
    shot = screenshot(2560, 1600, "PNG")
    url = "data:image/png;base64," + base64.b64encode(shot).decode()
    servers = {
        "cache": Server("kvserve", root, cache_dir=root / "cache"),
        "no-cache": Server("kvserve", root, cache_dir=root / "unused", no_cache=True),
    }
    results = image_turns(servers, url, rounds)
    print("\n| server | turn 2 TTFT (median) | cached / prompt tokens |")
    print("|---|---:|---:|")
    for name, rows in results.items():
        ttft = statistics.median(row.second.ttft for row in rows) * 1000
        last = rows[-1].second
        print(f"| {name} | {ttft:.0f} ms | {last.cached_tokens} / {last.prompt_tokens} |")


@dataclass
class Turns:
    first: Reply  # a long system prompt and a user turn with the image
    second: Reply  # then its answer and a question


def image_turns(servers: dict[str, Server], url: str, rounds: int) -> dict[str, list[Turns]]:
    """Each round, on each server (started and stopped here): turn 1 with the image at `url`,
    then turn 2; a fresh system prompt each round, so no round finds another's prefix."""
    client = http_client()
    results: dict[str, list[Turns]] = {name: [] for name in servers}
    for server in servers.values():
        server.start()
    for r in range(rounds):
        system = f"Round {r}. " + " ".join(f"Rule {i}: keep the answer short." for i in range(150))
        first = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is my screen. What is wrong with it?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            },
        ]
        for name, server in servers.items():
            one = chat(client, server, first, max_tokens=16)
            second = [
                *first,
                {"role": "assistant", "content": one.text},
                {"role": "user", "content": "And how do I fix it?"},
            ]
            results[name].append(Turns(one, chat(client, server, second, max_tokens=4)))
    for server in servers.values():
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-only", action="store_true")
    args = parser.parse_args()
    print(machine())
    decode_table(max(args.rounds, 5))
    if not args.decode_only:
        with workdir() as root:
            turn_two(args.rounds, root)


if __name__ == "__main__":
    main()
