"""A job for `mlx.launch` that exercises distributed.collective and prints what each rank saw
(one JSON line per rank). `hang` makes rank 1 stop answering; `die` makes it exit."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from mlx_kvserve.distributed.collective import Collective


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    c = Collective.join(timeout=float(os.environ.get("COLLECTIVE_TIMEOUT", "5")))
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
    print(json.dumps(seen), flush=True)
    if c.rank == 1 and mode == "hang":
        time.sleep(120)
    if c.rank == 1 and mode == "die":
        os._exit(9)
    c.barrier("the last barrier")
    print(json.dumps({"rank": c.rank, "done": True}), flush=True)


if __name__ == "__main__":
    main()
