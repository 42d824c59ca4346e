"""The config-only layer description (models/kv_shape.py, which docs/memory.md is computed
from) equals what the server asks of the loaded caches (cache/kinds.py), family by family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_kvserve.engine.ledger import KVCost
from mlx_kvserve.models.kv_shape import layers_from_config
from tests.support.tiny_models import make_model_dir

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma3_text", "gemma3", "gpt_oss"]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_config_describes_the_layers_the_caches_report(tmp_path, family, dtype):
    from mlx_lm import load

    from mlx_kvserve.cache.kinds import describe_model

    if dtype == "bfloat16" and family in ("qwen3_next", "gpt_oss"):
        pytest.skip("MLX's CPU backend runs expert matmuls (gather_mm) in float32 only")

    directory = make_model_dir(tmp_path / family, family, dtype=dtype)
    model, _ = load(str(directory))
    layout = describe_model(model)
    config = json.loads((directory / "config.json").read_text())
    size = 4 if dtype == "float32" else 2
    shapes = layers_from_config(config, dtype_bytes=size)
    got = [(s.kind, s.bytes_per_token, s.fixed_bytes, s.window) for s in shapes]
    want = [(k.kind, k.bytes_per_token, k.fixed_bytes, k.window) for k in layout.layers]
    assert got == want
    for n in (1, 100, 10_000):
        assert KVCost.of(shapes).bytes_for(n) == KVCost.of(layout.layers).bytes_for(n)


def test_the_fixture_configs_describe_every_layer():
    manifest = json.loads((FIXTURES / "models.json").read_text())
    assert len(manifest) >= 5
    for model in manifest:
        config = json.loads((FIXTURES / model["config"]).read_text())
        layers = layers_from_config(config)
        assert layers and all(layer.bytes_per_token or layer.fixed_bytes for layer in layers)
