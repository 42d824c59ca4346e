"""Chat and text completions against the real server, through the openai SDK and raw HTTP."""

from __future__ import annotations

import json
import uuid

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_kvserve import __version__
from tests.support.seeded import PLAIN

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments skipped)."""
    return [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]


def test_health_reports_model_and_version(server):
    data = httpx.get(server.base_url + "/health").json()
    assert data["status"] == "ok"
    assert data["model"] == MODEL
    assert data["version"] == __version__


def test_root_answers_probes(server):
    """Claude Code sends `HEAD /` before its first request; it and GET get a 200."""
    assert httpx.head(server.base_url + "/").status_code == 200
    reply = httpx.get(server.base_url + "/")
    assert reply.status_code == 200 and "running" in reply.text
    assert httpx.post(server.base_url + "/", json={}).status_code == 405


def test_models_list_and_lookup(server, openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_via_sdk(openai_client):
    # A system turn no other test sends: the shared server has never seen this prefix.
    fresh = [{"role": "system", "content": f"Session {uuid.uuid4().hex}."}, *QUESTION]
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=fresh, temperature=0, max_tokens=24
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason in {"stop", "length"}
    usage = resp.usage
    assert usage.prompt_tokens > 5
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Only the template's head ("<|im_start|>system\n") is shared with earlier conversations.
    assert usage.prompt_tokens_details.cached_tokens <= 3
    again = openai_client.chat.completions.create(
        model=MODEL, messages=fresh, temperature=0, max_tokens=24
    )
    assert again.choices[0].message.content == resp.choices[0].message.content
    # All of it is cached now but the last token, which is prefilled for the first logits.
    assert again.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_chat_response_matches_sdk_types_strictly(server):
    raw = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 4},
        timeout=60,
    ).json()
    ChatCompletion.model_validate(raw)
    assert set(raw["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_text_part_content_equals_string_content(openai_client):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    a = openai_client.chat.completions.create(
        model=MODEL, messages=parts, temperature=0, max_tokens=12
    )
    b = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_greedy_is_deterministic_and_streaming_matches(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    first = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    second = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == second
    chunks = list(
        openai_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == first
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in {"stop", "length"} and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_seeded_sampling_is_reproducible(openai_client):
    # decoded plainly: speculation's passes are timed, so their widths (and float rounding,
    # which a random model's near-uniform draw can feel) differ between runs (seeded.py)
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=1.0, top_p=0.9, max_tokens=16)
    kwargs["extra_body"] = PLAIN
    a = openai_client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    b = openai_client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    assert a == b


def test_text_completion_stream_and_not(openai_client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    kwargs["extra_body"] = {"ignore_eos": True}  # its 8 tokens, however the answer goes
    full = openai_client.completions.create(**kwargs)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    Completion.model_validate(full.model_dump())
    streamed = "".join(
        c.choices[0].text for c in openai_client.completions.create(**kwargs, stream=True)
    )
    assert streamed == full.choices[0].text


def test_length_finish(openai_client):
    resp = openai_client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3


def test_stop_string_cuts_output(openai_client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "List three colours, separated by commas."}],
        temperature=0,
        max_tokens=40,
    )
    full = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]  # a word from the middle of the answer
    expected = full[: full.index(stop)]
    for stop_arg in (stop, [stop, "zzzz-never"]):
        resp = openai_client.chat.completions.create(**kwargs, stop=stop_arg)
        assert resp.choices[0].message.content == expected
        assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in openai_client.chat.completions.create(**kwargs, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == expected


def test_raw_sse_framing(server):
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 5, "stream": True},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    payloads = sse_payloads(body)
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        ChatCompletionChunk.model_validate(json.loads(payload))


def test_model_may_be_omitted_in_raw_requests(server):
    resp = httpx.post(
        server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60
    )
    assert resp.status_code == 200
    assert resp.json()["model"] == MODEL


def _tokenizer():
    from transformers import AutoTokenizer

    from tests.support.tiny_models import default_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


def test_text_completion_from_token_ids(openai_client, server):
    """`prompt` as token ids, or a list of one prompt in either form, as the API allows."""
    text = "The capital of France is"
    ids = _tokenizer().encode(text)
    kwargs = dict(model=MODEL, temperature=0, max_tokens=6)
    expected = openai_client.completions.create(prompt=text, **kwargs)
    for prompt in (ids, [ids], [text]):
        got = openai_client.completions.create(prompt=prompt, **kwargs)
        assert got.choices[0].text == expected.choices[0].text
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens == len(ids)
    streamed = openai_client.completions.create(prompt=ids, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == expected.choices[0].text
    for bad, problem in (
        ([1, 2, 49152], "token id 49152 is outside the vocabulary (0 to 49151)"),
        ([5, -1], "token id -1 is outside the vocabulary"),
        ([], "prompt"),
        ([[1, 2], []], "prompt"),
        (["a"] * 65, "prompt"),
        ([1, "a"], "prompt"),
        ([1.5], "prompt"),
        ([True], "prompt"),
    ):
        resp = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": bad, "max_tokens": 1}, timeout=60
        )
        assert resp.status_code == 400, (bad, resp.text)
        error = resp.json()["error"]
        assert problem in error["message"] or error["param"].startswith(problem), (bad, error)
