"""Send a test's independent requests at once: the server batches them (continuous batching),
so a loop of N requests costs about one request's time, and the rows share a batch as real
clients' do."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")


def concurrently(call: Callable[[A], R], args: Iterable[A], workers: int = 8) -> list[R]:
    """`call` for every argument, at most `workers` at a time; the results in argument order
    (the first exception is raised, as in a plain loop)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(call, args))
