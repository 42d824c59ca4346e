"""Tiny random-weight models whose tokenizers and chat templates are a thinking family's own.

`build_thinking_model(dest, family)` writes an mlx-lm model directory that `serve --model DIR`
loads: a tiny random-weight model (tests/support/tiny_models.py), the default model's tokenizer
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

from tests.support.tiny_models import VOCAB, make_model_dir

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"
FAMILIES = {
    "qwen3": "qwen3.jinja",
    "qwen3.5": "qwen3.5.jinja",
    "deepseek-r1": "deepseek-r1-distill-qwen.jinja",
    "glm-4.6": "glm-4.6.jinja",
    "minimax-m2": "minimax-m2.jinja",
    "kimi-k2": "kimi-k2-thinking.jinja",
    "lfm2.5": "lfm2.5.jinja",
    "gemma4": "gemma4.jinja",
    "mistral-v13": "mistral-v13.jinja",
    "mistral-v11": "mistral-v11.jinja",
    "mistral-v7": "../mistral-v7.jinja",  # kept beside: tests/fixtures/README.md says why
    "deepseek-v3.1": "deepseek-v3.1.jinja",
    "llama3": "llama-3.1.jinja",
    "function-gemma": "functiongemma-minimal.jinja",  # no public template: a minimal one
    "longcat": "longcat-minimal.jinja",  # no public template: a minimal one
    "minicpm5": "minicpm5-minimal.jinja",  # no public template: a minimal one
    "laguna": "laguna-minimal.jinja",  # no public template: a minimal one
    "kimi-k3": "kimi-k3-minimal.jinja",  # no public template: a minimal one
    "muse-spark": "muse-spark-minimal.jinja",  # no public template: a minimal one
}
THINK_TOKENS = ("<think>", "</think>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")  # single tokens in Qwen's real vocabulary
GLM_TOOL_TOKENS = TOOL_TOKENS + ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
MINIMAX_TOOL_TOKENS = ("<minimax:tool_call>", "</minimax:tool_call>", "]~b]", "]~!b[", "[e~[")
LONGCAT_TOOL_TOKENS = tuple(
    f"<{c}longcat_{t}>" for t in ("tool_call", "arg_key", "arg_value") for c in ("", "/")
)
KIMI_K3_TOOL_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")  # XTML
KIMI_TOOL_TOKENS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
)
LFM_TOOL_TOKENS = ("<|tool_call_start|>", "<|tool_call_end|>")
# Gemma 4's turn, tool and string-delimiter tokens (its `<|"|>` quotes strings in calls)
GEMMA4_TOOL_TOKENS = (
    "<|turn>",
    "<turn|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|channel>",
    "<channel|>",
)
# Mistral's control tokens (Tekken tokenizers)
FUNCTION_GEMMA_TOOL_TOKENS = (  # FunctionGemma's turn, declaration and call tokens
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_function_declaration>",
    "<end_function_declaration>",
    "<start_function_call>",
    "<end_function_call>",
    "<start_function_response>",
    "<end_function_response>",
    "<escape>",
)
LLAMA3_TOOL_TOKENS = (  # Llama 3's header and turn tokens (its calls are plain JSON text)
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
MISTRAL_TOOL_TOKENS = (
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[TOOL_RESULTS]",
    "[TOOL_CONTENT]",
    "[/TOOL_RESULTS]",
)
DEEPSEEK_TOOL_TOKENS = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)


def build_thinking_model(
    dest: Path,
    family: str,
    *,
    architecture: str = "llama",
    seed: int = 0,
    tool_tokens: tuple[str, ...] = (),
    vocab_size: int | None = None,
) -> Path:
    """Write the tiny model of `family` (a FAMILIES key) into `dest`; return `dest`.

    `architecture` is any tests/support/tiny_models.py family (e.g. "qwen3_5" for caches that
    cannot be trimmed); `tool_tokens` adds these tags as tokens too, as the family's own
    tokenizer has them (TOOL_TOKENS: Qwen's), so calls tokenize as they do there; `vocab_size`
    sets the embedding rows (default: exactly the tokenizer's ids)."""
    added = THINK_TOKENS + tool_tokens
    rows = VOCAB + len(added) if vocab_size is None else vocab_size
    dest = make_model_dir(dest, architecture, seed=seed, vocab_size=rows)
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
            "special": False,
        }
        tokenizer["added_tokens"].append(token)
        decoder[str(next_id)] = {k: v for k, v in token.items() if k != "id"}
    assert next_id < rows
    config["chat_template"] = (TEMPLATES / FAMILIES[family]).read_text(encoding="utf-8")
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (dest / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
    return dest


def copy_model(src: Path, dest: Path) -> Path:
    """A second directory of the same model (e.g. to serve it with other settings)."""
    shutil.copytree(src, dest)
    return dest
