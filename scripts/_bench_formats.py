"""bench_grammar.py's per-format table: for every tool-call format the server can constrain, a
tiny random-weight model carrying a real chat template in that format, its decode tokens/s
without a grammar and with the format's grammar, side by side.

The formats come from the registry (`chat.formats.FORMATS`: those a model's own template
names, not gpt-oss's harmony, the Hermes fallback or a parser without a grammar), so a format
registered later gets its row without an edit here; its model is the first template in
tests/fixtures/templates whose format the server names after it. A registered format without
such a template is listed as lacking one.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from pathlib import Path

from _bench_common import ROOT, Server

sys.path.insert(0, str(ROOT))

TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
DECODE = re.compile(r"completion_tokens=(\d+) .*decode=([\d.]+) tok/s")
NO_THINKING = {"enable_thinking": False}  # the answer (and its grammar) starts at once
# registry entries without a row: gpt-oss's (its own bench), the fallback, formats parsed only
SKIPPED = ("harmony", "hermes", "parsed_only")
MODES = {
    "none (no grammar)": "none",
    "auto (lazy grammar)": "auto",
    "required (grammar)": "required",
}


def registered() -> list[str]:
    from mlx_kvserve.chat.formats import FORMATS

    names = [module.__name__.rsplit(".", 1)[-1] for module in FORMATS]
    return [name for name in names if name not in SKIPPED]


def _tool_tokens(template: str) -> tuple[str, ...]:
    """The tool tags the family's tokenizer has as tokens: those its template writes."""
    from tests.support.thinking_models import GLM_TOOL_TOKENS

    return tuple(tag for tag in GLM_TOOL_TOKENS if tag in template)


def models(work: Path) -> dict[str, tuple[str, Path]]:
    """{format: (family, model directory)} for every family in tests/support/thinking_models."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_kvserve.chat.formats import tool_format_for
    from tests.support.thinking_models import FAMILIES, build_thinking_model

    found: dict[str, tuple[str, Path]] = {}
    for family, template in FAMILIES.items():
        tags = _tool_tokens((TEMPLATES / template).read_text(encoding="utf-8"))
        dest = build_thinking_model(work / "formats" / family, family, tool_tokens=tags)
        fmt = tool_format_for(load_tokenizer(dest))
        name = fmt.name if fmt.native else ""
        if name and name not in found:
            found[name] = (family, dest)
    return found


def measure(server: Server, client, mode: str, tools: list[dict], max_tokens: int) -> float:
    """Decode tokens/s of one answer, as the engine logged it."""
    server.new_log_lines()
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What's the weather in Paris this week?"}],
        tools=tools,
        tool_choice=mode,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    for _ in range(100):
        for line in server.new_log_lines():
            if (m := DECODE.search(line)) and int(m.group(1)) > 2:
                return float(m.group(2))
            if m:
                return 0.0
        time.sleep(0.05)
    return 0.0


def run(work: Path, tools: list[dict], rounds: int, max_tokens: int) -> list[str]:
    """The table's lines (markdown)."""
    import openai

    found = models(work)
    formats = [f for f in registered() if f in found]
    rates: dict[str, dict[str, list[float]]] = {}
    refused: dict[str, str] = {}
    for name in formats:
        family, model = found[name]
        server = Server("kvserve", work, no_cache=True, extra=["--model", str(model)]).start()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        rates[name] = {mode: [] for mode in MODES}
        try:
            for mode in MODES.values():  # warm-up: grammar compile, tokenizer twin
                measure(server, client, mode, tools, 8)
            for _ in range(rounds):
                for label, mode in MODES.items():
                    rates[name][label].append(measure(server, client, mode, tools, max_tokens))
        except openai.BadRequestError as exc:  # e.g. a template that refuses the tool
            refused[name] = str(exc.message)[:120]
        finally:
            server.stop()
    labels = list(MODES)
    lines = [
        "| decode tok/s (median): format (family) | " + " | ".join(labels) + " | required / none |",
        "| --- |" + " ---: |" * (len(labels) + 1),
    ]
    for name in formats:
        if name in refused:
            lines.append(f"| {name} ({found[name][0]}) | refused: {refused[name]} |")
            continue
        median = {label: statistics.median(rates[name][label]) for label in labels}
        base, forced = median[labels[0]], median[labels[-1]]
        cells = " | ".join(f"{median[label]:.0f}" for label in labels)
        ratio = f"{forced / base:.2f}x" if base else "-"
        lines.append(f"| {name} ({found[name][0]}) | {cells} | {ratio} |")
    missing = [f for f in registered() if f not in found]
    if missing:
        lines.append(f"\nregistered formats without a fixture template: {', '.join(missing)}")
    return lines
