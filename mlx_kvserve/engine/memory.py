"""MLX memory discipline on a machine whose memory is shared with everything else. ENGINE THREAD.

* **Wired limit (Metal).** As mlx_lm.server does once at start-up
  (`mlx_lm/server.py`: `maybe_set_recommended_wired_limit()` in `main`), the engine raises the
  wired limit to the device's `max_recommended_working_set_size`
  (`mlx_lm/utils.py: maybe_set_recommended_wired_limit`), so the weights and KV stay resident
  instead of being paged out between requests, and warns, as `mlx_lm.generate.wired_limit` does,
  when the model alone is close to that size (`macos.metal_working_set`, the seam a test fakes
  to run this on Linux). Off Metal there is no such size and nothing is set. The previous
  limit is put back when the engine stops, after synchronizing, since the limit must not
  change under an async eval (`wired_limit`'s docstring).
* **Buffer cache.** MLX keeps freed buffers for reuse; a long prefill or a restore leaves GBs of
  them. `mx.set_cache_limit(limit)` bounds what is kept, and after a prefill of more than one
  chunk or a restore the cache is released (`mx.clear_cache()`, as `generate_step` does after
  each prefill chunk) when it holds more than the limit.
* **KV budget.** What requests hold (prompt and a growth reserve each, engine/ledger.py),
  resident sessions, the RAM tier and queued host copies together stay within a budget; by
  default half of what is left beside the weights: of the working set on Metal, of physical
  memory on the CPU.
* **Figures** for /v1/cache: MLX active, peak and cache memory, read on this thread.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_reduce

from mlx_kvserve import macos
from mlx_kvserve.engine.ledger import default_budget

log = logging.getLogger("mlx_kvserve.engine")


class MemoryPolicy:
    """Applies the limits above; every method runs on the engine thread."""

    def __init__(self, cache_limit: int, long_prefill: int = 512) -> None:
        self.cache_limit = max(0, int(cache_limit))
        self.long_prefill = long_prefill  # more tokens than one prefill chunk
        self._old_wired: int | None = None
        self.releases = 0

    def start(self, model: nn.Module) -> None:
        """After the model is loaded: wired limit (Metal) and the buffer-cache bound."""
        mx.set_cache_limit(self.cache_limit)
        limit = macos.metal_working_set()
        if limit is None:
            return
        try:
            self._old_wired = mx.set_wired_limit(limit)
        except (RuntimeError, ValueError) as exc:  # above the system's wired limit
            log.warning("could not set the wired limit to %d bytes: %s", limit, exc)
            return
        model_bytes = _model_bytes(model)
        log.info("wired limit %.1f GiB (model %.1f GiB)", limit / 2**30, model_bytes / 2**30)
        if model_bytes > 0.9 * limit:
            log.warning(
                "the model needs %d MB, close to the %d MB this machine can keep resident: "
                "expect it to be slow (see mlx-lm's notes on large models)",
                model_bytes // 2**20,
                limit // 2**20,
            )

    def default_kv_budget(self, model: nn.Module) -> int:
        """Half of the memory left beside the weights (engine/ledger.py: `default_budget`)."""
        total = macos.metal_working_set()
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return default_budget(total, _model_bytes(model))

    def stop(self) -> None:
        """Put the previous wired limit back, once no work is in flight."""
        if self._old_wired is not None:
            mx.synchronize()
            mx.set_wired_limit(self._old_wired)
            self._old_wired = None

    def after_prefill(self, prefilled: int, restored: bool) -> None:
        """Called once the prompt is in the KV cache, before decoding starts."""
        if restored or prefilled > self.long_prefill:
            self.release()

    def release(self) -> bool:
        """After a long prefill or a restore: free the buffer cache if it exceeds the limit."""
        if mx.get_cache_memory() <= self.cache_limit:
            return False
        mx.clear_cache()
        self.releases += 1
        return True

    def stats(self) -> dict[str, int]:
        return {
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "mlx_cache_limit": self.cache_limit,
            "mlx_cache_releases": self.releases,
            "mlx_wired_limit_set": self._old_wired is not None,
        }


def _model_bytes(model: nn.Module) -> int:
    return tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, model, 0)
