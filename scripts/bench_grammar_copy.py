#!/usr/bin/env python3
"""What walking a draft on a copy of a row's grammar costs (docs/speculation.md, "`auto` as
the default"): `Constraint.fork` (llguidance's `LLMatcher.deep_copy`) against one mask.

    python scripts/bench_grammar_copy.py
    python scripts/bench_grammar_copy.py --reps 5000 --properties 40

One process, no model: the default model's tokenizer and a tool grammar (a function of
`--properties` string parameters), forced (`tool_choice: required`) and lazy (`auto`), each fed
half a call; then the median over `--reps` of one `fork` and of one `allowed` (the mask a
step computes for each drafted position anyway). Speculation makes one fork per row that walks
a draft in a step, none for a row that drafts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import median_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--properties", type=int, default=20)
    args = parser.parse_args()

    from mlx_lm.tokenizer_utils import load

    from mlx_kvserve import paths
    from mlx_kvserve.chat.formats.hermes import FORMAT as HERMES
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.chat.request import ChatRequest, Message, Tool, ToolChoice
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    _, ref = resolve_model(None, paths.data_dir(), progress=False)
    tokenizer = load(Path(local_model_dir(ref)))
    compiler = GrammarCompiler(tokenizer)
    props = {f"p{i}": {"type": "string"} for i in range(args.properties)}
    tool = Tool("get_weather", None, {"type": "object", "properties": props})
    vocab = len(tokenizer.get_vocab())
    print(f"default model's tokenizer ({vocab} ids), a tool of {args.properties} parameters")
    print(f"median of {args.reps}")
    for kind in ("required", "auto"):
        chat = ChatRequest([Message("user", "x")], tools=[tool], tool_choice=ToolChoice(kind))
        constraint = compiler.constraint_for(chat, HERMES)
        assert constraint is not None
        text = "Some text first. " if kind == "auto" else ""
        text += '<tool_call>\n{"name": "get_weather", "arguments": {"p0": "Paris is a city'
        for token in tokenizer.encode(text, add_special_tokens=False):
            constraint.allowed(vocab)
            constraint.advance(token)
        fork = median_seconds(constraint.fork, args.reps)
        mask = median_seconds(lambda c=constraint: c.allowed(vocab), args.reps)
        print(f"  {kind:<9} fork {fork * 1e6:6.1f} us   one mask {mask * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
