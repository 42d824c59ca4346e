"""Speculative decoding's parts, each usable and tested on its own (issue 31, first slice).

- `drafts`: where a row's next tokens are guessed from (`DraftSource`), and prompt lookup, the
  first source: the tokens that followed the longest earlier match of the row's last n tokens.
"""

from mlx_kvserve.engine.speculation.drafts import Draft, Drafter, DraftSource, PromptLookup

__all__ = ["Draft", "DraftSource", "Drafter", "PromptLookup"]
