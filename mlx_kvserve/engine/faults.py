"""Fault injection for the crash-safety tests: a thin, named boundary, off unless asked for.

`MLX_KVSERVE_FAULTS` is a comma-separated list of rules:

* `point:N` fails the first N times the point is reached (0 = never; `point` alone = `point:1`);
* `point@K` fails only the K-th time (1-based), e.g. to crash in the middle of a workload.

What "fails" means depends on the point's name: `*_enospc`, `*_eio` and `*_eacces` raise the
OSError a full disk, a failing device or a permission problem would (see `OS_ERRORS`), `*_oom`
raises the RuntimeError Metal raises when memory runs out, `*_kill` logs one line and SIGKILLs
the whole process on the spot (a crash at an exact instant, e.g. halfway through writing a cache
file), `*_stall` sleeps for an hour (a process stuck where it stands, as a Mac gone to sleep),
anything else raises `InjectedFault`.

Points, on the engine thread, in the order of a request's life (`ENGINE_POINTS`, which also
says which take `<point>_oom`: `maybe_fail(point)` checks both rules):

* `turn`: the start of every turn of the engine loop, before it touches any request (a fault
  there fails nothing; three in a row stop the engine: engine/failures.py);
* `admission`: a request at the head of the queue is checked for room (engine/intake.py);
* `lookup`: the prompt-cache lookup of where a prefill starts (engine/prompt_state.py);
* `restore`, `restore_oom`: inside a restore (cache/restore.py): an error nobody expected,
  memory running out;
* `prefill_after_restore`: before the first chunk of a prefill that starts from reused state
  (engine/generate.py);
* `prefill_chunk`, `prefill_chunk_oom`: before each chunk's forward pass of a prefill (a
  request's, or a paused one's resumption), the last pass included: `prefill_chunk@K` fails
  the K-th chunk the engine runs;
* `prefill`, `prefill_oom`: before a prefill's last pass;
* `checkpoint`, `checkpoint_oom`: a checkpoint of live KV is stored (cache/store.py): during a
  prefill, after an answer, at a pause;
* `before_step`: the memory plan before a decode step, for every row of the batch;
* `pause`: a row is about to pause for memory (engine/room.py);
* `resume`: the oldest paused request is about to resume (engine/worker.py);
* `decode`, `decode_oom`: inside a decode step, a plain or a verify pass (`decode_stall`: the
  step never ends; for a job's tests).

A failure of the cache's (`lookup`, `restore`, `checkpoint`, the disk) or after a restore
(`prefill_after_restore`; a prefill from reused state) costs the request only speed: a failed
lookup or restore is tried again from less (engine/prompt_state.py, engine/blame.py: the newest
restored link is blamed and the request tried again from its parent), a failed checkpoint is
one checkpoint fewer, and memory running out evicts nothing and is tried again. Every other
point fails the requests it touched with a clean error, releases their KV holds, and the engine
serves the next request (engine/failures.py); tests/unit/test_fault_matrix.py runs every point
under each of its kinds. On the disk tier: `disk_write_kill` (cache/disk.py, halfway through an
entry's temporary file) and the `disk_<op>_<errno>` points (see "Disk-tier points" below).
Elsewhere (`OTHER_POINTS`): `read_body` (api/body.py, on the event loop: reading a request's
body). Across the ranks of a job: `request_decode` (distributed.request_wire: a request from
rank 0 that this rank cannot rebuild), and three points that `fires` instead of failing, where
the fault is another value: `draw_otherwise` (engine.sampling, and a verify pass's draws in
engine.speculation.verify: the step's tokens become other ones), `join_other_versions`
(distributed.join: this rank reports other versions), `verify_cost_otherwise`
(engine.speculation.job: this rank times its verify passes a thousand times dearer than they
were); a job's tests give the variable to one rank only, to make that rank differ from the
others.

Production code only ever calls `maybe_fail` (or `maybe_fail_disk`, or `fires`), which does
nothing when the variable is unset; `reset()` makes it read the variable again (tests).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time

ENV = "MLX_KVSERVE_FAULTS"
STALL_SECONDS = 3600.0

ERROR, OOM = "error", "oom"  # the kinds of fault an engine-thread point takes
# Each point on the engine thread (in the order of a request's life) and its kinds: ERROR under
# the point's own name, OOM under `<point>_oom` where memory can run out (see the docstring).
ENGINE_POINTS: dict[str, tuple[str, ...]] = {
    "turn": (ERROR,),
    "admission": (ERROR,),
    "lookup": (ERROR,),
    "restore": (ERROR, OOM),
    "prefill_after_restore": (ERROR,),
    "prefill_chunk": (ERROR, OOM),
    "prefill": (ERROR, OOM),
    "checkpoint": (ERROR, OOM),
    "before_step": (ERROR,),
    "pause": (ERROR,),
    "resume": (ERROR,),
    "decode": (ERROR, OOM),
}
# The other points production code reaches, beside the disk tier's `disk_<op>_<errno>`.
OTHER_POINTS = (
    "decode_stall",
    "disk_write_kill",
    "read_body",
    "request_decode",
    "draw_otherwise",
    "join_other_versions",
    "verify_cost_otherwise",
)

METAL_OUT_OF_MEMORY = (
    "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
)

_lock = threading.Lock()
_rules: dict[str, tuple[str, int]] | None = None
_calls: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """Raised at a fault point chosen by MLX_KVSERVE_FAULTS."""


def _load() -> dict[str, tuple[str, int]]:
    spec = os.environ.get(ENV, "")
    out: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if "@" in item:
            name, _, at = item.partition("@")
            out[name] = ("@", int(at))
        else:
            name, _, count = item.partition(":")
            out[name] = (":", int(count or 1))
    return out


def fires(point: str) -> bool:
    """Whether this reach of `point` is one its rule chose (each call counts as a reach)."""
    global _rules
    if _rules is not None and point not in _rules:
        return False  # the usual case, without the lock: no rule for this point
    with _lock:
        if _rules is None:
            _rules = _load()
        rule = _rules.get(point)
        if rule is None:
            return False
        n = _calls[point] = _calls.get(point, 0) + 1
        kind, value = rule
        return n <= value if kind == ":" else n == value


def fault_name(point: str, kind: str) -> str:
    """The rule name of `kind` at an engine-thread `point`: `turn`, `decode_oom`."""
    return point if kind == ERROR else f"{point}_{kind}"


_NAMES = {p: tuple(fault_name(p, k) for k in kinds) for p, kinds in ENGINE_POINTS.items()}


def maybe_fail(point: str) -> None:
    """Fail here if a rule chose this reach of `point` (of an engine-thread point: of any of
    its kinds, `ENGINE_POINTS`)."""
    for name in _NAMES.get(point, (point,)):
        _fail_if_chosen(name)


def _fail_if_chosen(point: str) -> None:
    if not fires(point):
        return
    if point.endswith("_stall"):
        logging.getLogger("mlx_kvserve").warning("injected fault at %s: stalled", point)
        time.sleep(STALL_SECONDS)
        return
    if (error := os_error(point)) is not None:
        raise error
    if point.endswith("_oom"):
        raise RuntimeError(f"{METAL_OUT_OF_MEMORY} (injected fault at {point})")
    if point.endswith("_kill"):
        logging.getLogger("mlx_kvserve").warning("injected fault at %s: SIGKILL", point)
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)  # not reached: SIGKILL to oneself lands at once
    raise InjectedFault(f"injected fault at {point}")


def reset() -> None:
    """Read `MLX_KVSERVE_FAULTS` again at the next point, with every count back at zero."""
    global _rules
    with _lock:
        _rules = None
        _calls.clear()


# -- Disk-tier points (cache/disk.py) -------------------------------------------------------
# `disk_<op>_<errno>`, e.g. `disk_fsync_eio@3` (the third entry fsync fails with EIO) or
# `disk_unlink_eacces:2`. Each (op, errno) pair counts its own occurrences. The ops:
#   write     an entry's temporary file, after its header is written
#   fsync     that file's fsync, before the rename
#   rename    the rename of the temporary file to the entry's name
#   dirsync   the directory fsync after the rename
#   header    reading an entry's header (start-up scan; a restore reading into the caches)
#   read      reading an entry's payload (a restore; the writer's read-back into RAM)
#   prefetch  the read-ahead hint before a restore of several small links
#   unlink    deleting an entry's file (eviction)
DISK_OPS = ("write", "fsync", "rename", "dirsync", "header", "read", "prefetch", "unlink")
OS_ERRORS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}


def os_error(point: str) -> OSError | None:
    """The OSError a point named `*_<errno>` raises (None for other points)."""
    name = point.rpartition("_")[2]
    code = OS_ERRORS.get(name)
    if code is None:
        return None
    return OSError(code, os.strerror(code), f"(injected fault at {point})")


def maybe_fail_disk(op: str) -> None:
    """The disk tier's point `op` (one of DISK_OPS), under each errno of OS_ERRORS."""
    for name in OS_ERRORS:
        maybe_fail(f"disk_{op}_{name}")


def reached(point: str) -> int:
    """How many times `point` was reached since the rules were read (for tests; only points
    that have a rule are counted)."""
    with _lock:
        return _calls.get(point, 0)
