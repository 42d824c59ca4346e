"""Ollama's native API through the official clients: `ollama` from PyPI, and from npm.

One server for the module: the default model (SmolLM2-135M, no reasoning, tools through the
Hermes format) and a tiny random-weight model with Qwen3.5's template and `<think>` tokens
("thinker"). Every answer a client receives is validated against Ollama's own OpenAPI
description (tests/support/ollama_spec.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import rawhttp
from tests.support.fuzz_ollama import PATHS, ollama_body
from tests.support.images import encoded
from tests.support.node_scripts import run_node_script
from tests.support.ollama_spec import Recorded, Recorder, check
from tests.support.servers import ServerProcess
from tests.support.thinking_models import build_thinking_model

MODEL = "SmolLM2-135M-Instruct"
THINKER = "thinker"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# Seeds at which the default model calls the tool for "What's the weather in Paris?" on its own
# (tried in order: one suffices).
CALL_SEEDS = (7, 9, 21, 3, 11, 13)
NPM_OLLAMA = "ollama@0.6.4"
JSON = "application/json"

NOTE = "[image: PNG 48x32, not shown: this model does not see images]"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("ollama")
    thinker = build_thinking_model(root / "thinker", "qwen3.5")
    proc = ServerProcess(
        root,
        "--model",
        "default",
        "--model",
        f"{THINKER}={thinker}",
        "--max-loaded-models",
        "2",
    )
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """Every answer the test's client received is checked against Ollama's description."""
    rec = Recorder()
    yield rec
    assert rec.check() > 0


@pytest.fixture
def client(served: ServerProcess, recorder: Recorder) -> ollama.Client:
    return ollama.Client(host=served.base_url, event_hooks=recorder.hooks())


def test_discovery_as_copilot_and_zed_do(served: ServerProcess, client: ollama.Client) -> None:
    """`/`, version, tags, show per model, ps: what the editors read before they chat."""
    root = httpx.get(served.base_url + "/")
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert httpx.head(served.base_url + "/").status_code == 200
    page = httpx.get(served.base_url + "/", headers={"Accept": "text/html"})
    assert page.headers["content-type"].startswith("text/html")  # a browser: the status page
    parts = [
        int(p) for p in httpx.get(served.base_url + "/api/version").json()["version"].split(".")
    ]
    assert parts >= [0, 6, 4]  # VS Code Copilot's minimum
    listed = client.list()
    assert [m.model for m in listed.models] == [MODEL, THINKER]
    for model in listed.models:
        assert model.details.format and model.details.family and model.details.parameter_size
        assert model.size > 0 and len(model.digest) == 64
    shown = {name: client.show(name) for name in (MODEL, THINKER)}
    for info in shown.values():
        arch = info.modelinfo["general.architecture"]
        assert info.modelinfo[f"{arch}.context_length"] > 0
        assert info.modelinfo["general.basename"]
        assert "num_ctx" in info.parameters and info.template
    assert shown[MODEL].capabilities == ["completion", "tools"]
    assert shown[THINKER].capabilities == ["completion", "tools", "thinking"]
    assert client.show(MODEL + ":latest").modelinfo == shown[MODEL].modelinfo
    running = client.ps()
    assert MODEL in [m.model for m in running.models]
    assert all(m.expires_at is not None and m.context_length for m in running.models)


def test_chat_streamed_and_whole_agree(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=MODEL, messages=messages, options=options, stream=False)
    chunks = list(client.chat(model=MODEL, messages=messages, options=options, stream=True))
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == chunks[-1].eval_count <= 12
    assert whole.done_reason in ("stop", "length")
    assert whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0


def test_generate_templated_raw_and_system(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 8}
    templated = client.generate(model=MODEL, prompt="Hello", options=options)
    raw = client.generate(model=MODEL, prompt="Hello", raw=True, options=options)
    # raw is the prompt alone; the template wraps it in the chat turns
    assert raw.prompt_eval_count < templated.prompt_eval_count
    # (longer than SmolLM2's default system prompt, which the template adds when none is given)
    system = "You answer in one short sentence, politely, and never ask a question back. " * 3
    briefed = client.generate(model=MODEL, prompt="Hello", system=system, options=options)
    assert briefed.prompt_eval_count > templated.prompt_eval_count
    pieces = list(client.generate(model=MODEL, prompt="Hello", options=options, stream=True))
    assert "".join(p.response for p in pieces) == templated.response
    # `context` continues the exchange; `template` replaces the chat template
    assert raw.context is None and len(templated.context) > templated.prompt_eval_count
    more = client.generate(model=MODEL, prompt="More", context=templated.context, options=options)
    assert more.context[: len(templated.context)] == templated.context
    mine = client.generate(
        model=MODEL,
        prompt="Hello",
        template="Q: {{ .Prompt }}\nA: {{ .Response }}",
        options=options,
    )
    assert mine.prompt_eval_count == len(mine.context) - mine.eval_count
    assert raw.prompt_eval_count < mine.prompt_eval_count < templated.prompt_eval_count
    assert pieces[-1].done and pieces[-1].eval_count == templated.eval_count


def test_tool_calls_are_objects_both_ways(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    for seed in CALL_SEEDS:
        options = {"seed": seed, "temperature": 1.0, "num_predict": 60}
        reply = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=options)
        if reply.message.tool_calls:
            break
    else:
        pytest.fail(f"no tool call at any of the seeds {CALL_SEEDS}")
    call = reply.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, dict) and "city" in call.function.arguments
    assert reply.done_reason == "stop"
    streamed = list(
        client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=options, stream=True)
    )
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or []]
    assert [c.function.model_dump() for c in calls] == [
        c.function.model_dump() for c in reply.message.tool_calls
    ]
    # the call goes back as an object, the result answers it by tool_name (no ids, as Zed sends)
    history = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"},
    ]
    answer = client.chat(model=MODEL, messages=history, tools=[WEATHER], options={"num_predict": 8})
    assert answer.done


def test_format_json_and_schema(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    reply = client.chat(model=MODEL, messages=ask, format=schema, options={"num_predict": 40})
    value = json.loads(reply.message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    person = "Give a JSON object with the keys name and city for a fictional person."
    generated = client.generate(
        model=MODEL, prompt=person, format="json", options={"temperature": 0, "num_predict": 100}
    )
    assert generated.done_reason == "stop"
    assert isinstance(json.loads(generated.response), dict)
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(
            model=MODEL,
            messages=ask,
            format={"type": "object", "properties": {"a": {"type": "nonsense"}}},
        )
    assert bad.value.status_code == 400


def test_think_onto_the_reasoning_switch(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    options = {"num_predict": 24, "seed": 1}
    thinking = client.chat(model=THINKER, messages=ask, think=True, options=options)
    assert thinking.message.thinking  # the random model reasons until its budget or its end
    plain = client.chat(model=THINKER, messages=ask, think=False, options=options)
    assert not plain.message.thinking
    default = client.chat(model=THINKER, messages=ask, options=options)  # Ollama: on
    assert default.message.thinking == thinking.message.thinking
    leveled = list(
        client.chat(model=THINKER, messages=ask, think="low", options=options, stream=True)
    )
    assert "".join(c.message.thinking or "" for c in leveled)
    generated = client.generate(model=THINKER, prompt="Hi", think=True, options=options)
    assert generated.thinking
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=ask, think=True)
    assert refused.value.status_code == 400 and "does not support thinking" in refused.value.error


def test_options_onto_sampling(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Tell me a story."}]
    first = client.chat(model=MODEL, messages=ask, options={"seed": 42, "num_predict": 10})
    again = client.chat(
        model=MODEL, messages=ask, options={"seed": 42, "num_predict": 10, "mirostat": 2}
    )
    assert first.message.content == again.message.content  # mirostat: unknown, ignored
    assert first.eval_count == 10 and first.done_reason == "length"
    greedy = client.chat(model=MODEL, messages=ask, options={"temperature": 0, "num_predict": 10})
    assert len(greedy.message.content) > 6
    word = greedy.message.content[3:6]
    stopped = client.chat(
        model=MODEL, messages=ask, options={"temperature": 0, "num_predict": 10, "stop": [word]}
    )
    assert word not in stopped.message.content and stopped.done_reason == "stop"
    topk = client.chat(
        model=MODEL, messages=ask, options={"top_k": 1, "top_p": 0.5, "num_predict": 10}
    )
    assert topk.message.content == greedy.message.content  # top_k 1 is greedy
    for options, named in (
        ({"num_ctx": 10**6}, "num_ctx"),
        ({"temperature": "hot"}, "temperature"),
    ):
        with pytest.raises(ollama.ResponseError) as bad:
            client.chat(model=MODEL, messages=ask, options=options)
        assert bad.value.status_code == 400 and named in bad.value.error


def _loaded(client: ollama.Client) -> list[str]:
    return [m.model for m in client.ps().models]


def test_keep_alive_loads_and_unloads(client: ollama.Client) -> None:
    loaded = client.generate(model=THINKER, prompt="", keep_alive="5m")
    assert loaded.done_reason == "load" and THINKER in _loaded(client)
    unloaded = client.chat(model=THINKER, messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and THINKER not in _loaded(client)
    # keep_alive 0 on a real request: answered, then unloaded once idle
    client.chat(
        model=THINKER,
        messages=[{"role": "user", "content": "Hi"}],
        keep_alive=0,
        think=False,
        options={"num_predict": 2},
    )
    deadline = time.monotonic() + 30
    while THINKER in _loaded(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert THINKER not in _loaded(client)
    # a model kept for ever: Ollama's far-future expiry
    client.generate(model=THINKER, prompt="", keep_alive=-1)
    expiry = next(m.expires_at for m in client.ps().models if m.model == THINKER)
    assert expiry.year > 2100


def test_images_from_the_client_answer(client: ollama.Client) -> None:
    """The client's `images` (it base64-encodes the bytes) on chat and generate: a model that
    does not see images answers with a note in their place (docs/images.md)."""
    png = encoded("PNG", 48, 32)
    chat = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "What is this?", "images": [png]}],
        options={"num_predict": 2, "temperature": 0},
    )
    generated = client.generate(
        model=MODEL, prompt="What is this?", images=[png], options={"num_predict": 2}
    )
    assert chat.done and generated.done
    plain = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": f"{NOTE}\nWhat is this?"}],
        options={"num_predict": 2, "temperature": 0},
    )
    assert chat.prompt_eval_count == plain.prompt_eval_count


def test_errors_in_ollama_shape(
    served: ServerProcess, client: ollama.Client, recorder: Recorder
) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="llama3.2:1b", messages=[{"role": "user", "content": "Hi"}])
    assert unknown.value.status_code == 404 and "not found" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as images:  # "hi": not an image (docs/images.md)
        client.chat(model=MODEL, messages=[{"role": "user", "content": "?", "images": ["aGk="]}])
    assert images.value.status_code == 400 and "messages[0].images[0]" in images.value.error
    assert "not an image" in images.value.error
    with pytest.raises(ollama.ResponseError) as suffix:
        client.generate(model=MODEL, prompt="def f(", suffix="return 1")
    assert suffix.value.status_code == 400 and "insert" in suffix.value.error
    assert client.pull(MODEL).status == "success"
    assert [p.status for p in client.pull(MODEL, stream=True)][-1] == "success"
    with pytest.raises(ollama.ResponseError) as pull:
        client.pull("llama3.2:1b")
    assert pull.value.status_code == 404
    for call in (
        lambda: client.copy(MODEL, "copy"),
        lambda: client.delete(MODEL),
        lambda: client.create("mine", from_=MODEL),
        lambda: client.push(MODEL),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 501 and "not supported" in refused.value.error
    with httpx.Client(base_url=served.base_url, event_hooks=recorder.hooks()) as raw:
        assert (
            raw.post(
                "/api/chat", json={"model": MODEL, "messages": [], "think": "maybe"}
            ).status_code
            == 400
        )
        assert raw.post("/api/chat", json={"model": MODEL, "keep_alive": "soon"}).status_code == 400
        assert raw.post("/api/show", json={}).status_code == 400
        assert raw.get("/api/nothing").status_code == 404
        bad_template = {"model": MODEL, "prompt": "x", "template": "{{ range .Messages }}"}
        assert raw.post("/api/generate", json=bad_template).status_code == 400


def test_npm_client(served: ServerProcess, tmp_path: Path) -> None:
    """The `ollama` npm package: list, show, chat streamed with a tool, generate, and generate
    continued from the `context` it returned."""
    env = {
        "HOST": served.base_url,
    }
    out = run_node_script(NPM_OLLAMA, "ollama-js", NODE_SCRIPT, tmp_path, env)
    assert out["version"] and out["models"] == [MODEL, THINKER]
    assert out["capabilities"] == ["completion", "tools", "thinking"]
    assert out["chunks"] > 1 and out["final"]["done"] and out["final"]["eval_count"] > 0
    check(Recorded("POST", "/api/chat", 200, "application/json", json.dumps(out["final"]).encode()))
    assert out["generated"]["done"] and isinstance(out["generated"]["response"], str)
    context = out["generated"]["context"]  # continued: the next exchange starts with it
    assert context and out["continued"]["context"][: len(context)] == context
    assert out["error"] == 404


NODE_SCRIPT = """
const { Ollama } = require('ollama');
const MODEL = 'SmolLM2-135M-Instruct';
(async () => {
  const client = new Ollama({ host: process.env.HOST });
  const out = {};
  out.version = (await client.version()).version;
  out.models = (await client.list()).models.map((m) => m.model);
  out.capabilities = (await client.show({ model: 'thinker' })).capabilities;
  let chunks = 0;
  const stream = await client.chat({
    model: MODEL, stream: true, options: { num_predict: 8, temperature: 0 },
    messages: [{ role: 'user', content: 'Hello' }],
  });
  for await (const part of stream) { chunks += 1; if (part.done) out.final = part; }
  out.chunks = chunks;
  const options = { num_predict: 4 };
  out.generated = await client.generate({ model: MODEL, prompt: 'Hi', options });
  const context = out.generated.context;
  out.continued = await client.generate({ model: MODEL, prompt: 'More', context, options });
  try {
    await client.chat({ model: 'nope', messages: [{ role: 'user', content: 'x' }] });
    out.error = 0;
  } catch (e) { out.error = e.status_code; }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(served: ServerProcess, data: st.DataObject) -> None:
    """Whatever the body, an answer in Ollama's shape: a 4xx `{"error": ...}`, or a 200 whose
    lines and final object validate (tests/support/ollama_spec.py)."""
    path = data.draw(st.sampled_from(PATHS))
    body = data.draw(ollama_body(path))
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(served.base_url + path, content=body, headers=headers, timeout=120)
    assert reply.status_code < 500, (body, reply.status_code, reply.text[:300])
    media = reply.headers.get("content-type", "").split(";")[0]
    check(Recorded("POST", path, reply.status_code, media, reply.content))


def test_disconnect_mid_stream_frees_the_row(served: ServerProcess) -> None:
    """A client that leaves an NDJSON stream: the engine stops its row, and serves the next."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "options": {"num_predict": 4000, "temperature": 1.0, "seed": 5},
    }
    with httpx.stream("POST", served.base_url + "/api/chat", json=body, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        lines = reply.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(served.base_url + "/health").json()
        if health["running"] == 0 and health["queued"] == 0:
            break
        time.sleep(0.1)
    assert health["running"] == 0 and health["queued"] == 0
    after = httpx.post(
        served.base_url + "/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
        timeout=60,
    )
    assert after.status_code == 200 and after.json()["done"] is True


HOST = ("Host", "127.0.0.1")
BODY = b'{"model": "x"}'


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ([("Host", "evil.example"), ("Content-Type", JSON)], BODY, 403),
        ([HOST, ("Origin", "https://evil.example"), ("Content-Type", JSON)], BODY, 403),
        # a browser's simple POST (it always adds Sec-Fetch-* or Origin): never read
        ([HOST, ("Content-Type", "text/plain"), ("Sec-Fetch-Mode", "no-cors")], BODY, 415),
        ([HOST, ("Content-Type", JSON), ("Content-Length", "99999999999")], b"", 413),
        ([HOST, ("Content-Type", JSON)], b"", 400),  # no body at all
    ],
)
def test_hostile_headers_in_ollama_shape(
    served: ServerProcess, headers: list[tuple[str, str]], body: bytes, status: int
) -> None:
    """The guard's and the body reader's refusals on `/api/*` are Ollama's `{"error": ...}`
    (a request HTTP cannot parse is refused before any route, in the server's own shape)."""
    reply = rawhttp.request(served.port, "POST", "/api/chat", headers, body)
    assert reply.status == status, reply.body
    check(Recorded("POST", "/api/chat", status, "application/json", reply.body))


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_curl_as_ollamas_docs_show_it_is_served(served: ServerProcess, content_type) -> None:
    """`curl .../api/generate -d '{...}'` sends a form Content-Type: Ollama reads the body as
    JSON, and so does this server on `/api/*` when no browser header says a page sent it; a
    foreign Origin is still refused, and the OpenAI routes still want JSON."""
    body = json.dumps(
        {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    )
    headers = [HOST, *([("Content-Type", content_type)] if content_type else [])]
    reply = rawhttp.request(served.port, "POST", "/api/generate", headers, body.encode())
    assert reply.status == 200, reply.body
    assert reply.json()["done"] is True
    evil = [*headers, ("Origin", "http://evil.example")]
    assert rawhttp.request(served.port, "POST", "/api/generate", evil, body.encode()).status == 403
    openai = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    assert rawhttp.request(served.port, "POST", "/v1/completions", headers, openai).status == 415
