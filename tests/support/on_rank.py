"""`python tests/support/on_rank.py RANK NAME=VALUE ... -- COMMAND ...`: COMMAND with those
environment variables on rank RANK of an `mlx.launch` job only (its `MLX_RANK`), as it is on
the others: how a job's tests make one rank differ (engine/faults.py). Run as a script, so the
ranks need not import the tests."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    split = sys.argv.index("--")
    rank, *pairs = sys.argv[1:split]
    command = sys.argv[split + 1 :]
    if os.environ.get("MLX_RANK") == rank:
        os.environ.update(pair.split("=", 1) for pair in pairs)
    os.execvp(command[0], command)
