"""mlx-kvserve: a local OpenAI-compatible MLX server with a persistent prompt (KV) cache."""

__version__ = "0.1.0"
