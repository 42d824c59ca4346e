"""The suite's servers read memory pressure from a file saying "normal", not from the machine.

A server unloads idle models when the system's memory pressure rises (models/pressure_watch.py).
On a machine shared with other test runs, PSI rises and falls with them, and a server under test
would unload its model between two requests at a moment no test chose (seen: a 503 while the
model reloaded). Every server the suite starts, in process or not, inherits this setting; the
tests of pressure itself name their own file (tests/server/test_memory_pressure.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mlx_kvserve.models.pressure import FILE_ENV, NORMAL


def calm_memory_pressure() -> None:
    """Point MLX_KVSERVE_PRESSURE_FILE at a file saying "normal" unless it is set already."""
    if os.environ.get(FILE_ENV):
        return
    level = Path(tempfile.mkdtemp(prefix="mlx-kvserve-pressure-")) / "level"
    level.write_text(NORMAL)
    os.environ[FILE_ENV] = str(level)
