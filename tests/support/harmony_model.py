"""A tiny random-weight gpt-oss model that speaks harmony as far as its tokenizer goes.

`build_harmony_model(dest)` writes an mlx-lm `gpt_oss` model directory
(tests/support/tiny_models.py) whose tokenizer is the default model's plus gpt-oss's harmony
control tokens, added as special tokens as in gpt-oss's own tokenizer (`<|start|>`,
`<|channel|>`, `<|message|>`, ...; `<|endoftext|>` is the default model's own), and whose chat
template is gpt-oss's real one (tests/fixtures/templates/gpt-oss.jinja). Its end-of-sequence
token is `<|return|>` alone, as the real config.json's `eos_token_id` is: that `<|call|>` ends a
generation too is the server's business (chat.formats.harmony).

Random weights never write a harmony header by chance: the tests make the model speak harmony
through the format's grammar (tool calls), which leaves each choice inside it to the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_models import VOCAB, make_model_dir, padded_vocab

TEMPLATE = Path(__file__).resolve().parent.parent / "fixtures" / "templates" / "gpt-oss.jinja"
# gpt-oss's special tokens (o200k_harmony): the ones the format and the template use.
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)


def build_harmony_model(dest: Path, *, seed: int = 0) -> Path:
    """Write the tiny harmony model into `dest`; return `dest`."""
    added = HARMONY_TOKENS
    rows = padded_vocab(VOCAB + len(added))  # gpt-oss: 201,088 rows for o200k_harmony's 200,019
    dest = make_model_dir(dest, "gpt_oss", seed=seed, vocab_size=rows)
    tokenizer = json.loads((dest / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    next_id = max(
        [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    )
    decoder = config.setdefault("added_tokens_decoder", {})
    for text in added:
        next_id += 1
        token = {
            "id": next_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        tokenizer["added_tokens"].append(token)
        decoder[str(next_id)] = {k: v for k, v in token.items() if k != "id"}
    assert next_id < rows
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    # gpt-oss's generation_config.json: <|return|>, <|endoftext|>, <|call|>
    generation = {"eos_token_id": [ids["<|return|>"], 0, ids["<|call|>"]]}
    (dest / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    config["chat_template"] = TEMPLATE.read_text(encoding="utf-8")
    config["eos_token"] = "<|return|>"
    config["bos_token"] = "<|startoftext|>"
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (dest / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
    return dest
