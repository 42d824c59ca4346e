"""harmony's control tokens, how a model is known to speak it, and one call's parse (the format:
chat.formats.harmony)."""

from __future__ import annotations

import json

from mlx_kvserve.chat.tokenizer import Tokenizer, per_tokenizer
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import token_ids

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
CONTROL = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN, "<|endoftext|>")
ENDS = (CALL, RETURN, "<|endoftext|>")  # tokens that end the assistant's turn
FUNCTIONS = "functions."


@per_tokenizer
def is_harmony(tokenizer: Tokenizer) -> bool:
    """The model speaks harmony: its vocabulary has the control tokens and its template uses
    them (gpt-oss's does; a template of another family on the same vocabulary does not)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or f"{CHANNEL}commentary" not in template:
        return False
    vocab = token_ids(tokenizer)  # empty for a tokenizer without one: not harmony
    return all(token in vocab for token in (START, END, MESSAGE, CHANNEL, CALL))


def parse_tool_call(text: str, tools: list[dict[str, JSON]] | None = None) -> dict[str, JSON]:
    """One call's text, `NAME<|message|>{arguments}` (the header reduced to the function's name),
    as {"name", "arguments"}; ValueError when the arguments are not a JSON object."""
    name, _, body = text.partition(MESSAGE)
    arguments = json.loads(body) if body.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("the arguments of a harmony call must be a JSON object")
    return {"name": name.strip(), "arguments": arguments}
