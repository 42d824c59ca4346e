"""A job for `mlx.launch` that exercises distributed.collective and prints what each rank saw
(one JSON line per rank). `hang` makes rank 1 stop answering; `die` makes it exit; `hostile-*`
makes it add a huge length to rank 0's `share` header, or a negative size to a `gather`."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import mlx.core as mx

from mlx_kvserve.distributed.collective import FIRST_BUFFER, HEADER, Collective


def emit(doc: dict) -> None:
    """One line in one write: print's two writes (the text, then its newline) let mlx.launch
    forward another rank's line between them."""
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    c = Collective.join(timeout=float(os.environ.get("COLLECTIVE_TIMEOUT", "5")))
    if mode.startswith("hostile"):
        hostile(c, mode)
        return
    big = {"text": "é" * 3000, "tokens": list(range(500))}
    seen = {
        "rank": c.rank,
        "size": c.size,
        "small": c.share({"tick": 1} if c.is_leader else None),
        "big": c.share(big if c.is_leader else None) == big,
        "none": c.share(None),
        "vote_all": c.all_true(True),
        "vote_one": c.all_true(c.rank == 0),
        "same": c.all_equal("fingerprint"),
        "differ": c.all_equal(f"fingerprint-{c.rank}"),
        # compared here: a line of several KiB per rank comes back cut up by mlx.launch
        "gathered": c.gather({"rank": c.rank, "text": "é" * (700 * c.rank)})
        == [{"rank": r, "text": "é" * (700 * r)} for r in range(c.size)],
    }
    emit(seen)
    if c.rank == 1 and mode == "hang":
        time.sleep(120)
    if c.rank == 1 and mode == "die":
        os._exit(9)
    c.barrier("the last barrier")
    emit({"rank": c.rank, "done": True})


def hostile(c: Collective, mode: str) -> None:
    """Rank 1 takes part in rank 0's collective with bytes no rank would send."""
    if c.rank == 1:
        if mode == "hostile-share":  # a message of a TiB announced
            first = bytearray(FIRST_BUFFER)
            first[:HEADER] = (1 << 40).to_bytes(HEADER, "little")
            c._sum(mx.array(memoryview(first), dtype=mx.uint8), "a hostile share")
        else:  # rank 0's size made negative
            lengths = mx.zeros((c.size,), dtype=mx.int32)
            lengths[0] = -(2**30)
            c._sum(lengths, "a hostile gather")
        time.sleep(30)
    elif mode == "hostile-share":
        c.share({"tick": 1}, "the engine's turn")
    else:
        c.gather({"host": "a"}, "model check")
    emit({"rank": c.rank, "done": True})


if __name__ == "__main__":
    main()
