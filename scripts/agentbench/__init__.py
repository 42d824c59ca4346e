"""Pieces of `scripts/bench_agents.py`: the two servers as clients see them (`side`), the
workloads (`workloads`), and the tables, JSON and plots (`report`). Nothing here imports MLX."""
