"""Observability: Prometheus metrics for the HTTP layer, the engine and the prompt cache."""

from mlx_kvserve.observe.metrics import Metrics

__all__ = ["Metrics"]
