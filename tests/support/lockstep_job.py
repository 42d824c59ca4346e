"""A job for `mlx.launch` that drives engine.lockstep over the real collectives: rank 0 decides,
the others replay, cancellations follow, and a rank whose batch differs ends the job. Prints one
JSON line per rank and turn."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from mlx_kvserve.distributed.collective import Collective
from mlx_kvserve.engine.lockstep import Lockstep
from mlx_kvserve.engine.requests import CancelLatch


class Wire:
    """Requests as their id only: enough to follow them by id."""

    def encode(self, req):
        return {"id": req.request_id}

    def decode(self, wire):
        return request(wire["id"], leader=False)


def request(request_id: str, *, leader: bool) -> SimpleNamespace:
    import threading

    return SimpleNamespace(
        request_id=request_id, cancelled=CancelLatch() if leader else threading.Event()
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    c = Collective.join(timeout=5)
    step = Lockstep(c, Wire())
    leader = c.is_leader
    mine = request("a", leader=True) if leader else None

    def say(**seen) -> None:
        print(json.dumps({"rank": c.rank, **seen}), flush=True)

    step.tick([], [0])  # turn 1: a request arrives and two decisions follow it
    got = step.next_item(lambda: mine)
    first = step.decide(lambda: 5)
    second = step.decide(lambda: [["a", 2]])
    step.flush()
    say(turn=1, item=got.request_id, first=first, second=second)

    if leader:  # turn 2: the client left between turns; every rank hears of it at once
        got.cancelled.hold()  # shared in turn 1 (the engine's wire holds it)
        got.cancelled.set()
    step.tick([got], [1])
    none = step.next_item(lambda: None)
    step.flush()
    say(turn=2, item=none, cancelled=got.cancelled.is_set(), empty=step.all_true(True, "vote"))

    step.tick([got], [2] if leader else [3])  # turn 3: this rank's batch is not rank 0's
    step.next_item(lambda: None)
    step.flush()
    say(turn=3)


if __name__ == "__main__":
    main()
