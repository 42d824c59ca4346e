"""The context window read from config.json: plain configs, text_config wrappers, gpt-oss's
RoPE pair, and the model's own args as the last resort."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlx_kvserve.models.context import context_from_config, context_from_model, read_context_length


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "llama", "max_position_embeddings": 8192}, 8192),
        # Qwen3.5 / multimodal Gemma 3 conversions: the window sits in text_config.
        ({"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 262144}}, 262144),
        # gpt-oss as published: the explicit field wins over the RoPE pair...
        (
            {
                "model_type": "gpt_oss",
                "max_position_embeddings": 131072,
                "initial_context_length": 4096,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0},
            },
            131072,
        ),
        # ...and without it the pair gives the same window.
        (
            {
                "model_type": "gpt_oss",
                "initial_context_length": 4096,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0},
            },
            131072,
        ),
        ({"rope_scaling": {"original_max_position_embeddings": 4096, "factor": 4}}, 16384),
        ({"model_type": "gpt2", "n_positions": 1024}, 1024),
        ({"model_type": "llama"}, None),
        ({"max_position_embeddings": 0, "text_config": "not a dict"}, None),
        ({"max_position_embeddings": True}, None),
        ({"max_position_embeddings": "8192"}, None),
    ],
)
def test_context_from_config(config, expected):
    assert context_from_config(config) == expected


def test_model_args_are_the_last_resort(tmp_path):
    wrapper = SimpleNamespace(
        args=SimpleNamespace(model_type="gemma3"),
        language_model=SimpleNamespace(args=SimpleNamespace(max_position_embeddings=32768)),
    )
    assert context_from_model(wrapper) == 32768
    assert context_from_model(SimpleNamespace()) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    assert read_context_length(tmp_path, wrapper) == 32768
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"n_ctx": 4096}}))
    assert read_context_length(tmp_path, wrapper) == 4096
    (tmp_path / "config.json").write_text("{broken")
    assert read_context_length(tmp_path) is None
    assert read_context_length(tmp_path / "missing", wrapper) == 32768
