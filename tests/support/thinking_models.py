"""Tiny random-weight models whose tokenizers and chat templates are a thinking family's own.

`build_thinking_model(dest, family)` writes an mlx-lm model directory that `serve --model DIR`
loads: a llama of tiny dimensions with random weights (seeded), the default model's tokenizer
with `<think>` and `</think>` added as tokens (so mlx-lm detects the reasoning markers as it
does for Qwen3 and DeepSeek-R1), and the family's real chat template from tests/fixtures.

Such a model reasons honestly under a template whose generation prompt opens `<think>`: it
rarely writes `</think>` by chance, so everything it samples is reasoning until a thinking
budget makes the server force the end of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"
FAMILIES = {
    "qwen3": "qwen3.jinja",
    "qwen3.5": "qwen3.5.jinja",
    "deepseek-r1": "deepseek-r1-distill-qwen.jinja",
}
THINK_TOKENS = ("<think>", "</think>")


def default_model_dir() -> Path:
    """The converted default model (its tokenizer files are the base), converted if needed."""
    from mlx_kvserve.models.default_model import ensure_default_model
    from mlx_kvserve.paths import data_dir

    return ensure_default_model(data_dir(), progress=False)


def build_thinking_model(dest: Path, family: str, *, seed: int = 0) -> Path:
    """Write the tiny model of `family` (a FAMILIES key) into `dest`; return `dest`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    base = default_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = max(
        [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    )
    config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    decoder = config.setdefault("added_tokens_decoder", {})
    for text in THINK_TOKENS:
        next_id += 1
        token = {
            "id": next_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        tokenizer["added_tokens"].append(token)
        decoder[str(next_id)] = {k: v for k, v in token.items() if k != "id"}
    config["chat_template"] = (TEMPLATES / FAMILIES[family]).read_text(encoding="utf-8")
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for stale in ("chat_template.jinja", "chat_template.json"):
        (dest / stale).unlink(missing_ok=True)

    args = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": next_id + 1,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(args))
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(
        json.dumps({**args, "architectures": ["LlamaForCausalLM"]}), encoding="utf-8"
    )
    return dest


def copy_model(src: Path, dest: Path) -> Path:
    """A second directory of the same model (e.g. to serve it with other settings)."""
    shutil.copytree(src, dest)
    return dest
