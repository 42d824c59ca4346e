"""Fill in the middle: the code before the cursor and the code after it, in the tokens a code
model was trained to read them with (Ollama's `suffix`; editors' completion providers).

A model has a format when its vocabulary has the format's tokens, each as one token: the
families' published prompts (Qwen2.5-Coder's and Qwen3-Coder's model cards, StarCoder's,
DeepSeek-Coder's, Codestral's `[SUFFIX]`/`[PREFIX]`, which puts the suffix first). The text is
then tokenized whole, as Ollama tokenizes its template's output: the tokenizer adds its BOS
where it always does and reads the format's tokens as the single tokens they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_kvserve.vocabulary import token_ids


@dataclass(frozen=True)
class FillFormat:
    prefix: str
    suffix: str
    middle: str = ""  # none: the suffix comes first and the prefix runs into the answer

    def prompt(self, before: str, after: str) -> str:
        if not self.middle:
            return f"{self.suffix}{after}{self.prefix}{before}"
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


FORMATS = (
    FillFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5/3-Coder
    FillFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite Code
    FillFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    FillFormat("[PREFIX]", "[SUFFIX]"),  # Codestral
)


def fill_format(tokenizer: object) -> FillFormat | None:
    """The model's fill-in-the-middle format, or None when it has none."""
    vocab = token_ids(tokenizer)
    for fmt in FORMATS:
        marks = [fmt.prefix, fmt.suffix, *([fmt.middle] if fmt.middle else [])]
        if all(mark in vocab for mark in marks):
            return fmt
    return None
