#!/usr/bin/env python3
"""Prompt-cache reuse through agent tool loops, per turn, on each protocol.

    python scripts/agent_loops.py            # default model, 8 OpenAI turns, 6 Anthropic turns

Starts one mlx-kvserve server and runs, with the official SDKs:
* an OpenAI chat tool loop (user, forced call, tool result, next question, ...);
* an Anthropic Messages tool loop (tool_use / tool_result blocks);
* an OpenAI Responses loop (function_call / function_call_output items);
* Claude Code's billing-header pair: two requests whose system prompts differ only in the
  `cch=` value of their first line.
For every turn it prints the prompt tokens, the tokens read from the cache and that share of the
previous turn's prompt (the issue's target is at least 90% from the second turn on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Server, machine, workdir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
}
CITIES = ["Rome", "Oslo", "Lima", "Kyiv", "Doha", "Baku", "Suva", "Riga", "Bern", "Apia"]
SYSTEM = "You are a weather assistant ({}). Use the tools to answer."  # one per loop: each
# loop starts cold, so its figures are its own (rendered alike, the loops would share a cache)


def row(turn: int, prompt: int, cached: int, previous: int | None) -> str:
    share = f"{cached / previous:.1%}" if previous else "-"
    return f"| {turn} | {prompt} | {cached} | {share} |"


def openai_loop(base: str, turns: int) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [
        {"role": "system", "content": SYSTEM.format("chat")},
        {"role": "user", "content": "Paris?"},
    ]
    rows, previous = [], None
    for turn in range(1, turns + 1):
        reply = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=tools,
            temperature=0,
            max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        u = reply.usage
        rows.append(row(turn, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, previous))
        previous = u.prompt_tokens
        call = reply.choices[0].message.tool_calls[0]
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C, clear"})
        messages.append({"role": "user", "content": f"And {CITIES[turn % len(CITIES)]}?"})
    return rows


def anthropic_loop(base: str, turns: int) -> list[str]:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    messages: list[dict] = [{"role": "user", "content": "Paris?"}]
    rows, previous = [], None
    for turn in range(1, turns + 1):
        reply = client.messages.create(
            model="m",
            system=SYSTEM.format("messages"),
            messages=messages,
            tools=tools,
            max_tokens=60,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        u = reply.usage
        total = u.input_tokens + u.cache_read_input_tokens
        rows.append(row(turn, total, u.cache_read_input_tokens, previous))
        previous = total
        use = next(b for b in reply.content if b.type == "tool_use")
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear"},
                    {"type": "text", "text": f"And {CITIES[turn % len(CITIES)]}?"},
                ],
            }
        )
    return rows


def responses_loop(base: str, turns: int) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    items: list[dict] = [{"role": "user", "content": "Paris?"}]
    rows, previous = [], None
    for turn in range(1, turns + 1):
        reply = client.responses.create(
            model="m",
            instructions=SYSTEM.format("responses"),
            input=items,
            tools=tools,
            temperature=0,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
        )
        u = reply.usage
        rows.append(row(turn, u.input_tokens, u.input_tokens_details.cached_tokens, previous))
        previous = u.input_tokens
        call = next(i for i in reply.output if i.type == "function_call")
        items.append(
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "21 C"})
        items.append({"role": "user", "content": f"And {CITIES[turn % len(CITIES)]}?"})
    return rows


def billing_pair(base: str) -> list[str]:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    system = "You are Claude Code. " + "Follow the repository conventions carefully. " * 60
    rows = []
    for n, cch in enumerate(["a1b2c", "9f3e7"], start=1):
        reply = client.messages.create(
            model="m",
            max_tokens=2,
            messages=[{"role": "user", "content": "List the files."}],
            system=f"x-anthropic-billing-header: cc_version=2.1.37; cch={cch};\n{system}",
        )
        u = reply.usage
        total = u.input_tokens + u.cache_read_input_tokens
        rows.append(
            f"| {n} | {total} | {u.cache_read_input_tokens} | "
            f"{u.cache_read_input_tokens / total:.1%} of its own input |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--openai-turns", type=int, default=8)
    p.add_argument("--anthropic-turns", type=int, default=6)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    with workdir(args.keep) as work:
        server = Server("kvserve", work, cache_dir=work / "cache").start()
        sections = [
            ("OpenAI chat tool loop", openai_loop(server.base_url, args.openai_turns)),
            ("Anthropic Messages tool loop", anthropic_loop(server.base_url, args.anthropic_turns)),
            (
                "OpenAI Responses function-call loop",
                responses_loop(server.base_url, args.anthropic_turns),
            ),
            ("Claude Code billing-header pair", billing_pair(server.base_url)),
        ]
        server.stop()
    print(f"machine: {machine()}\n")
    for title, rows in sections:
        print(f"### {title}\n\n| turn | prompt tokens | read from cache | vs previous prompt |")
        print("| --- | --- | --- | --- |")
        print("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
