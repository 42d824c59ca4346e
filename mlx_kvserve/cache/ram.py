"""RAM tier: host copies of entry payloads, LRU within a byte budget.

It holds plain host arrays (numpy, bfloat16 as uint16), the same objects the writer thread
writes, so a fresh checkpoint costs its bytes once in memory and a hot hit never reads the disk.
Which payloads may be dropped is the store's decision (pending writes and entries that exist
only in RAM are protected or evicted as whole entries); this class only keeps order and bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from mlx_kvserve.cache.codec import HostArray


class RamTier:
    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self._items: OrderedDict[str, tuple[HostArray, ...]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.nbytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> tuple[HostArray, ...] | None:
        """Payload of `key` (marks it most recently used)."""
        arrays = self._items.get(key)
        if arrays is not None:
            self._items.move_to_end(key)
        return arrays

    def put(self, key: str, arrays: Sequence[HostArray]) -> None:
        self.drop(key)
        size = sum(a.nbytes for a in arrays)
        self._items[key] = tuple(arrays)
        self._sizes[key] = size
        self.nbytes += size

    def drop(self, key: str) -> bool:
        if key not in self._items:
            return False
        del self._items[key]
        self.nbytes -= self._sizes.pop(key)
        return True

    def size_of(self, key: str) -> int:
        return self._sizes.get(key, 0)

    def over_budget(self, extra: int = 0) -> bool:
        return self.nbytes + extra > self.budget

    def lru_victims(self, protected: Iterable[str], extra: int = 0) -> list[str]:
        """Least recently used keys to drop (in order) to fit `extra` more bytes in the budget."""
        keep = set(protected)
        need = self.nbytes + extra - self.budget
        victims = []
        for key in self._items:
            if need <= 0:
                break
            if key in keep:
                continue
            victims.append(key)
            need -= self._sizes[key]
        return victims

    def keys(self) -> list[str]:
        return list(self._items)

    def clear(self) -> None:
        self._items.clear()
        self._sizes.clear()
        self.nbytes = 0
