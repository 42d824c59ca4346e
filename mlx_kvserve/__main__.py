"""`python -m mlx_kvserve` is the same as the `mlx-kvserve` console script."""

from mlx_kvserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
