"""`mlx-kvserve cluster join` with a model directory per rank, for `mlx.launch` in the tests:
`python -m tests.support.cluster_join_job DIR0 [DIR1 ...] -- [join options]`; rank r uses
DIR r (the last for ranks beyond), so a test can give one rank different model files."""

from __future__ import annotations

import os
import sys

from mlx_kvserve.cli import main

if __name__ == "__main__":
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    dirs, options = sys.argv[1:split], sys.argv[split + 1 :]
    rank = int(os.environ.get("MLX_RANK", "0"))
    sys.exit(main(["cluster", "join", "--model", dirs[min(rank, len(dirs) - 1)], *options]))
