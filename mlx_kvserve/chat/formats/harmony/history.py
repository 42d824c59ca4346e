"""gpt-oss's history as its chat template reads it.

The template, as gpt-oss ships it, decides how past turns look; this module feeds it what it
reads: past reasoning as `thinking`, the key it reads (recent transformers copy `reasoning_content`
there too; older ones do not), which it replays for a tool-call turn until a final answer
follows, one call per assistant message (an OpenAI message with several calls is split, each
call followed by its result), the tool results as `functions.NAME to=assistant` messages, and
system messages after the first as `<system-reminder>` text in a user turn (the template keeps
only the first).
"""

from __future__ import annotations

from mlx_kvserve.json_value import JSON


def harmony_messages(messages: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
    """Message dicts (OpenAI shape, arguments as objects, past reasoning as
    `reasoning_content`) as gpt-oss's template reads them."""
    out: list[dict[str, JSON]] = []
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
            turn: dict[str, JSON] = {"role": "assistant", "content": "", "tool_calls": [call]}
            if n == 0 and analysis:
                turn["thinking"] = analysis
            out.append(turn)
            answer = [r for r in results if r.get("tool_call_id") == call.get("id")]
            out.extend(answer[:1])
        out.extend(r for r in results if all(r.get("tool_call_id") != c.get("id") for c in calls))
    return out


def harmony_tools(tools: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
    """Function tools as the template reads them: it writes each description as a comment and
    fails on a tool without one, so a missing description is an empty one."""
    out = []
    for tool in tools:
        function = tool["function"]
        if function.get("description") is None:
            tool = {**tool, "function": {**function, "description": ""}}
        out.append(tool)
    return out


def _reminder(text: str) -> dict[str, JSON]:
    return {"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"}
