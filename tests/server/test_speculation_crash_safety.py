"""A SIGKILL while a server speculates loses nothing (issue 31; DESIGN invariants 5-6).

A real server with `--speculation auto` on a tiny random-weight llama (the default model's
architecture and tokenizer, as tests/server/test_crash_safety.py): a first turn that copies a
file is answered and stored, drafting (its log line says so); a second turn continuing it is
killed while it decodes, drafting as the first did. The server restarted on the same cache
directory finds the entry intact (nothing dropped or evicted as damaged, no temporary file
left), reuses the first turn's prefix for the second, and answers both as a `--no-cache`
server without speculation does.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from mlx_kvserve.cache import codec
from tests.support.kill_loop import (
    cache_env,
    cache_stats,
    entry_files,
    is_failure_eviction,
    temp_files,
    wait_for_writes,
)
from tests.support.servers import ServerProcess, client_for
from tests.support.tiny_models import make_model_dir

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
COPY = f"Here is a file:\n\n{CODE}\nThe same file again, unchanged:\n\n{CODE}\nAnd again:\n\n"


def tokens_of(entry: Path) -> list[int]:
    """The tokens a stored entry holds (its header)."""
    raw = entry.read_bytes()
    header_len, digest, _ = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    return [int(t) for t in codec.decode_tokens(header["tokens"])]


def complete(server: ServerProcess, prompt: str | list[int], max_tokens: int):
    return client_for(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def drafted(log: str) -> list[tuple[int, int]]:
    """(drafted, accepted) of each request log line that drafted."""
    return [(int(d), int(a)) for d, a in re.findall(r"drafted=(\d+) accepted=(\d+)", log)]


def test_a_sigkill_while_speculating_loses_nothing(tmp_path, start_server):
    model = make_model_dir(tmp_path / "model", "llama", seed=0)
    args = ("--model", str(model), "--served-model-name", "tiny")
    reference = start_server(*args, "--no-cache", "--speculation", "off")
    root = tmp_path / "kv"
    first = start_server(*args, "--speculation", "auto", env=cache_env(root))

    complete(first, COPY, 48)
    stored = {e["key"] for e in wait_for_writes(first)["entries_list"]}
    assert stored, "the first turn stored nothing"
    (kept,) = drafted(first.wait_for_log("drafted="))
    assert kept[0] > 0 and kept[1] > 0, first.log()  # this text drafts, and keeps drafts
    (entry,) = entry_files(root)  # the first turn's tokens, as the model drew them
    turn = tokens_of(entry) + tokens_of(entry)[:40]  # and its beginning again, as ids
    stream = client_for(first).completions.create(
        model="tiny", prompt=turn, max_tokens=2000, temperature=0, stream=True
    )
    received = 0
    for chunk in stream:  # killed while it decodes: a few verify passes in
        received += len(chunk.choices[0].text) if chunk.choices else 0
        if received >= 80:
            first.proc.send_signal(signal.SIGKILL)
            break
    assert first.proc.wait(30) == -signal.SIGKILL
    stream.close()

    again = start_server(*args, "--speculation", "auto", env=cache_env(root))
    assert "the last run ended uncleanly" in again.log()
    assert stored <= {e["key"] for e in cache_stats(again)["entries_list"]}
    assert temp_files(root) == []
    both = [complete(again, turn, 60), complete(again, COPY, 48)]  # the stored prefix first
    assert [b.choices[0].text for b in both] == [
        complete(reference, turn, 60).choices[0].text,
        complete(reference, COPY, 48).choices[0].text,
    ]
    assert both[0].usage.prompt_tokens_details.cached_tokens == len(tokens_of(entry))
    log = wait_for_writes(again) and again.log()
    assert "dropped damaged file" not in log and "dropped orphan" not in log, log
    assert not [line for line in log.splitlines() if is_failure_eviction(line)], log
    assert all(d > 0 and a > 0 for d, a in drafted(again.wait_for_log("drafted=", after=1)))
