"""Ollama's `/api/generate` prompt building, in process (the real app and engine on tiny
random-weight models with the default model's tokenizer): `context` returned and continued,
`template` in place of the chat template, `suffix` in the model's fill-in-the-middle tokens
(a model without them: Ollama's 400), `raw`'s refusals, and integer options given as floats.
The prompt a request was given is read back from the `context` it returns (prompt + answer
ids) and `prompt_eval_count`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer
from starlette.testclient import TestClient

from tests.support.in_process import serve
from tests.support.thinking_models import build_thinking_model
from tests.support.tiny_models import make_model_dir

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen2.5-Coder's
GREEDY = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    return {
        "plain": make_model_dir(root / "plain", "llama"),
        # the default tokenizer with Qwen's fill-in-the-middle tokens added
        "coder": build_thinking_model(root / "coder", "qwen3", tool_tokens=FIM),
    }


@pytest.fixture(scope="module")
def plain(dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(dirs["plain"], "plain") as client:
        yield client


@pytest.fixture(scope="module")
def coder(dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(dirs["coder"], "coder") as client:
        yield client


def generate(client: TestClient, **body) -> dict:
    reply = client.post("/api/generate", json={"stream": False, "options": GREEDY, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def refused(client: TestClient, **body) -> str:
    reply = client.post("/api/generate", json={"stream": False, "options": GREEDY, **body})
    assert reply.status_code == 400, reply.text
    assert list(reply.json()) == ["error"]
    return reply.json()["error"]


def test_context_is_the_exchange_and_continues_it(plain: TestClient) -> None:
    first = generate(plain, model="plain", prompt="Hello")
    context = first["context"]
    assert len(context) == first["prompt_eval_count"] + first["eval_count"]
    again = generate(plain, model="plain", prompt="Hello")
    assert again["context"] == context  # greedy: the same exchange
    then = generate(plain, model="plain", prompt="And then?", context=context)
    assert then["context"][: len(context)] == context
    alone = generate(plain, model="plain", prompt="And then?")
    assert then["prompt_eval_count"] == len(context) + alone["prompt_eval_count"]
    lines = plain.post(
        "/api/generate",
        json={"model": "plain", "prompt": "And then?", "context": context, "options": GREEDY},
    ).text.splitlines()
    chunks = [json.loads(line) for line in lines]
    assert "context" not in chunks[0] and chunks[-1]["context"] == then["context"]
    raw = generate(plain, model="plain", prompt="Hello", raw=True)
    assert "context" not in raw  # as Ollama: raw mode returns none
    assert "context" in refused(plain, model="plain", prompt="x", context=[10**9])
    assert "raw mode does not support" in refused(
        plain, model="plain", prompt="x", raw=True, context=context
    )


def test_template_replaces_the_chat_template(plain: TestClient, dirs) -> None:
    tokenizer = load_tokenizer(dirs["plain"])
    template = "{{ if .System }}S: {{ .System }}\n{{ end }}U: {{ .Prompt }}\nA: {{ .Response }}"
    told = generate(plain, model="plain", prompt="Hi", system="Be brief.", template=template)
    expected = tokenizer.encode("S: Be brief.\nU: Hi\nA: ")
    assert told["context"][: len(expected)] == expected
    assert told["prompt_eval_count"] == len(expected)
    bare = generate(plain, model="plain", prompt="Hi", template=template)
    assert bare["prompt_eval_count"] == len(tokenizer.encode("U: Hi\nA: "))
    for bad in (
        "{{ range .Messages }}x{{ end }}",
        "{{ if .System }}x",
        "{{ .Tools }}",
        "{{ .Response }}",
    ):
        reply = plain.post("/api/generate", json={"model": "plain", "prompt": "x", "template": bad})
        assert reply.status_code == 400 and reply.json()["error"].startswith("template:")
    assert "raw mode" in refused(plain, model="plain", prompt="x", raw=True, template=template)


def test_suffix_fills_in_the_middle_with_the_models_tokens(coder: TestClient, dirs) -> None:
    tokenizer = load_tokenizer(dirs["coder"])
    shown = coder.post("/api/show", json={"model": "coder"}).json()
    assert "insert" in shown["capabilities"]
    filled = generate(coder, model="coder", prompt="def f(x):\n    ", suffix="\n    return y")
    expected = tokenizer.encode(
        "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>"
    )
    marks = [tokenizer.convert_tokens_to_ids(t) for t in FIM]
    assert all(mark in expected for mark in marks)  # each one token
    assert filled["context"][: len(expected)] == expected
    templated = generate(
        coder,
        model="coder",
        prompt="a",
        suffix="b",
        template="{{ if .Suffix }}<|fim_suffix|>{{ .Suffix }}<|fim_prefix|>{{ .Prompt }}{{ end }}",
    )
    spm = tokenizer.encode("<|fim_suffix|>b<|fim_prefix|>a")
    assert templated["context"][: len(spm)] == spm


def test_suffix_on_a_model_without_those_tokens_is_ollamas_400(plain: TestClient) -> None:
    shown = plain.post("/api/show", json={"model": "plain"}).json()
    assert "insert" not in shown["capabilities"]
    error = refused(plain, model="plain", prompt="def f(", suffix="return 1")
    assert error.startswith('"plain" does not support insert')


def test_integer_options_given_as_floats_are_cut_as_ollama_cuts_them(plain: TestClient) -> None:
    whole = generate(plain, model="plain", prompt="Hi", options={"top_k": 1, "num_predict": 3})
    cut = generate(plain, model="plain", prompt="Hi", options={"top_k": 1.9, "num_predict": 3.7})
    assert cut["eval_count"] == 3 and cut["response"] == whole["response"]


@pytest.mark.parametrize(
    ("template", "values", "text"),
    [
        ("{{ .System }}|{{ .Prompt }}", {"System": "s", "Prompt": "p"}, "s|p"),
        ("{{.Prompt}} {{ .Response }}<eos>", {"Prompt": "p"}, "p "),  # cut at .Response
        ("a  {{- .Prompt -}}  b", {"Prompt": "p"}, "apb"),  # trim markers
        ("{{ if .System }}S{{ else if .Suffix }}F{{ else }}P{{ end }}.", {"Suffix": "x"}, "F."),
        ("{{ if .System }}S{{ else }}{{ if .Prompt }}P{{ end }}{{ end }}", {"Prompt": "p"}, "P"),
        ("{{/* a comment */}}x", {}, "x"),
    ],
)
def test_the_go_template_subset(template: str, values: dict, text: str) -> None:
    from mlx_kvserve.api.ollama_template import render

    assert render(template, values) == text


def test_format_holds_a_plain_text_answer_to_json(plain: TestClient) -> None:
    """With `raw`, `template` or `suffix` the answer is plain text; `format` still decodes it
    under the JSON grammar, as Ollama applies it whatever the prompt."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    options = {"temperature": 0, "num_predict": 40}
    raw = generate(plain, model="plain", prompt="Answer:", raw=True, format=schema, options=options)
    assert raw["done_reason"] == "stop" and set(json.loads(raw["response"])) == {"ok"}
    templated = generate(
        plain,
        model="plain",
        prompt="Hi",
        template="Q: {{ .Prompt }}\nA:",
        format=schema,
        options=options,
    )
    assert set(json.loads(templated["response"])) == {"ok"}
    bad = refused(plain, model="plain", prompt="x", raw=True, format={"type": "nonsense"})
    assert "format" in bad
    assert "format" in refused(plain, model="plain", prompt="x", raw=True, format="yaml")
