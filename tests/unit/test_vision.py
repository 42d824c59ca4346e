"""A vision model (Gemma 3) sees images: its text model is mlx-lm's, its tower mlx-vlm's, and
the answer to an image prompt is the one mlx-vlm's own forward gives on the same weights
(docs/images.md). Real app and engine in this process, a tiny random-weight checkpoint
(tests/support/vision_models.py), real PNGs made with Pillow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.engine import Engine
from tests.support.concurrently import concurrently
from tests.support.images import b64, data_url, encoded
from tests.support.in_process import serve_vision
from tests.support.vision_models import TOKENS_PER_IMAGE

pytest.importorskip("mlx_vlm")

RED = encoded("PNG", 64, 40, (200, 30, 30))
GREEN = encoded("PNG", 64, 40, (20, 220, 40))  # RED's size: only the pixels differ
TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.vision_models import gemma3_vision_dir

    return gemma3_vision_dir(tmp_path_factory.mktemp("vision") / "gemma3")


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    # The prompt cache keys image spans by pixel hash only once the cache does (images/spans.py):
    # these tests compare answers across images, so no state is reused between requests.
    with serve_vision(model_dir, "tiny-vision", cache_enabled=False) as c:
        yield c


def chat(client: TestClient, image: bytes | None, text: str = "What is in the picture?") -> dict:
    parts: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        parts.append({"type": "image_url", "image_url": {"url": data_url(image)}})
    body = {
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def answer(response: dict) -> str:
    """All the model wrote: a template whose prompt opens `<think>` (Qwen3.5's) makes the
    answer reasoning until the model closes it."""
    message = response["choices"][0]["message"]
    return (message.get("reasoning_content") or "") + (message["content"] or "")


def reference(model_dir: Path, text: str, image: bytes) -> str:
    """mlx-vlm's own answer on the same checkpoint, nothing of ours: its chat template and
    processor (tokens and pixels), its `get_input_embeddings` and language model, greedy over
    the tokenizer's ids."""
    import io
    import json

    import mlx.core as mx
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image as PILImage

    processor = load_processor(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    prompt = apply_chat_template(processor, config, text, num_images=1)
    picture = PILImage.open(io.BytesIO(image)).convert("RGB")
    inputs = processor(text=[prompt], images=[picture], add_special_tokens=False)
    model = load_model(model_dir)
    ids = mx.array([list(inputs["input_ids"][0])])
    embedded = model.get_input_embeddings(
        ids, mx.array(inputs["pixel_values"]), mask=mx.ones_like(ids)
    )
    cache = model.language_model.make_cache()
    logits = model.language_model(ids, inputs_embeds=embedded.inputs_embeds, cache=cache).logits
    size = len(processor.tokenizer)
    out: list[int] = []
    for _ in range(TOKENS):
        token = int(mx.argmax(logits[0, -1, :size]).item())
        out.append(token)
        logits = model.language_model(mx.array([[token]]), cache=cache).logits
    return processor.tokenizer.decode(out)


def test_the_answer_to_an_image_is_mlx_vlms(client: TestClient, model_dir: Path) -> None:
    text = "What is in the picture?"
    got = chat(client, RED, text)
    want = reference(model_dir, text, RED)
    assert answer(got).strip() == want.strip()  # (the answer's leading space is trimmed)
    # count_tokens renders the image as /v1/chat/completions does
    assert got["usage"]["prompt_tokens"] == counted(client, text, RED)


def counted(client: TestClient, text: str, image: bytes) -> int:
    """Anthropic's count_tokens of the same turn: the image counted as its placeholders."""
    r = client.post(
        "/v1/messages/count_tokens",
        json={
            "model": "tiny-vision",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": text},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": b64(image),
                            },
                        },
                    ],
                }
            ],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_a_different_image_gives_a_different_answer(client: TestClient) -> None:
    assert answer(chat(client, RED)) != answer(chat(client, GREEN))
    assert answer(chat(client, RED)) == answer(chat(client, RED))


def test_image_and_text_requests_batched_answer_as_alone(client: TestClient) -> None:
    alone = [answer(chat(client, image)) for image in (RED, None, GREEN, None)]
    together = concurrently(lambda image: answer(chat(client, image)), [RED, None, GREEN, None])
    assert together == alone


def test_the_model_lists_vision(client: TestClient) -> None:
    models = client.get("/v1/models").json()["data"]
    assert "vision" in models[0]["capabilities"]
    shown = client.post("/api/show", json={"model": "tiny-vision"}).json()
    assert "vision" in shown["capabilities"]


def test_a_repeated_image_runs_the_tower_once(client: TestClient) -> None:
    chat(client, None)  # the model is loaded
    engine = client.app.state.pool.slots[0].engine
    blue = encoded("PNG", 30, 30, (0, 0, 250))
    before = engine.vision.encoded
    first = answer(chat(client, blue))
    assert engine.vision.encoded == before + 1
    assert answer(chat(client, blue)) == first  # the same pixels: their features, from RAM
    assert engine.vision.encoded == before + 1


def test_chunks_never_split_an_image(model_dir: Path) -> None:
    """A prefill step of 3 would cut every image in two; the chunks end at its edges instead,
    and the answer is mlx-vlm's still."""
    with serve_vision(model_dir, "tiny-vision", cache_enabled=False, prefill_step=3) as small_steps:
        got = answer(chat(small_steps, GREEN, "Describe it."))
    want = reference(model_dir, "Describe it.", GREEN)
    assert got.strip() == want.strip()


def test_chunk_ends_move_to_an_images_start() -> None:
    from mlx_kvserve.engine.chunks import Checkpoints, plan_chunks
    from mlx_kvserve.images.spans import ImageSpan

    spans = (ImageSpan(4, 4, "00" * 32), ImageSpan(9, 4, "11" * 32))
    with_images = Checkpoints({}, 0, lambda *a, **k: None, spans=spans)
    assert with_images.cuts(0, 12, 3) == [3, 4, 9]  # 12 is inside the second image
    assert Checkpoints({}, 0, lambda *a, **k: None).cuts(0, 12, 3) == [3, 6, 9, 12]
    # no checkpoint, folded into the last pass or not, inside an image: it moves to its start
    marked = Checkpoints({6: "anchor"}, 10, lambda *a, **k: None, spans=spans)
    assert marked.for_prompt(0, 14, foldable=True).boundaries == {4: "anchor", 9: "interval"}
    # a start inside an image (state reused up to there) keeps its place
    assert plan_chunks(5, 6, 3, with_images, foldable=True) == ([], 5)


def test_text_posing_as_image_tokens_is_a_400(client: TestClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "look <image_soft_token><image_soft_token>"}],
        "max_tokens": 1,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert "placeholder" in r.json()["error"]["message"]


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "responses", "ollama"])
def test_fuzzed_image_fields_on_a_vision_model(client: TestClient, protocol: str) -> None:
    """Whatever the image field holds, a model that sees images answers or says 400 in the
    protocol's shape: never a 5xx (a real image of any size and format reaches the tower)."""
    from tests.unit.test_images_api import fuzz_image_field

    fuzz_image_field(client, protocol, "tiny-vision", examples=25)


def test_a_quantized_tower_answers_as_mlx_vlm(tmp_path: Path) -> None:
    """A checkpoint whose tower is stored 4-bit: its layers are quantized as stored (the text
    model stays as it is), and the answer is mlx-vlm's on the same files."""
    from tests.support.vision_models import gemma3_vision_dir

    quantized = gemma3_vision_dir(tmp_path / "q", quantized=True)
    with serve_vision(quantized, "tiny-vision", cache_enabled=False) as c:
        got = answer(chat(c, RED, "Describe it."))
    assert got.strip() == reference(quantized, "Describe it.", RED).strip()


def test_an_image_in_a_cluster_job_is_a_400(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's other ranks get the request over a wire that carries no pixels: an image there
    is refused, and a text request is still answered."""
    monkeypatch.setattr(Engine, "cluster", property(lambda _self: {"ranks": 2}))
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}],
            }
        ],
        "max_tokens": 1,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "images_not_supported"
    assert chat(client, None)["choices"]


def _reply_text(route: str, body: dict) -> str:
    if route == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if route == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    if route == "/v1/responses":
        return "".join(
            c.get("text", "") for item in body["output"] for c in item.get("content", [])
        )
    if route == "/api/chat":
        return body["message"]["content"]
    return body["response"]


@pytest.mark.parametrize(
    "protocol", ["openai", "anthropic", "responses", "ollama", "ollama-generate"]
)
def test_each_protocols_image_is_seen(client: TestClient, protocol: str) -> None:
    """Every protocol's image field, Ollama's /api/generate `images` included: the same image
    the same greedy answer, another image another one."""
    from tests.unit.test_images_api import good_image, image_body

    def ask(image: bytes) -> str:
        route, body = image_body(protocol, good_image(protocol, image))
        body = {"model": "tiny-vision", "temperature": 0.0, **body}
        if route.startswith("/api/"):
            body |= {"stream": False, "options": {"num_predict": TOKENS, "temperature": 0}}
        else:
            body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = TOKENS
        reply = client.post(route, json=body)
        assert reply.status_code == 200, reply.text
        return _reply_text(route, reply.json())

    red = ask(RED)
    assert red and ask(RED) == red
    assert ask(GREEN) != red


def test_the_prompt_and_pixels_are_mlx_vlms(model_dir: Path) -> None:
    """A one-turn image prompt renders to the very tokens mlx-vlm's chat template and
    processor make, and the image to the very pixels."""
    import io
    import json

    import numpy as np
    from mlx_lm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_processor
    from PIL import Image as PILImage

    from mlx_kvserve.chat import ChatRequest, Message
    from mlx_kvserve.chat.render import render_chat
    from mlx_kvserve.images.pixels import ImageLimits, decode_image
    from mlx_kvserve.vision.encoder import load_vision

    text = "What is in the picture?"
    processor = load_processor(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    prompt = apply_chat_template(processor, config, text, num_images=1)
    picture = PILImage.open(io.BytesIO(RED)).convert("RGB")
    theirs = processor(text=[prompt], images=[picture], add_special_tokens=False)

    _, tokenizer = load(str(model_dir))
    vision = load_vision(model_dir, tokenizer.convert_ids_to_tokens)
    image = decode_image(RED, ImageLimits(1 << 24, 1 << 24), "image")
    ours = render_chat(
        tokenizer, ChatRequest([Message.from_parts("user", [text, image])]), vision=vision
    )
    assert ours.tokens == [int(t) for t in theirs["input_ids"][0]]
    assert np.array_equal(vision.family.pixels(image), np.asarray(theirs["pixel_values"]))
    (span,) = ours.image_spans
    assert ours.tokens[span.start : span.end] == [config["image_token_index"]] * span.length
    assert ours.tokens[span.start - 1] == config["boi_token_index"]
    assert ours.tokens[span.end] == config["eoi_token_index"]


def cached_client(model_dir: Path, cache_dir: Path) -> TestClient:
    """The vision app with a prompt cache on `cache_dir` (a new one each call: a restart)."""
    from mlx_kvserve.cache import PromptCache

    cache = PromptCache(cache_dir, "tiny-vision", disk_budget=256 << 20, ram_budget=64 << 20)
    return serve_vision(model_dir, "tiny-vision", prompt_cache=cache)


def converse(client: TestClient, image: bytes, turns: list[str]) -> list[dict]:
    """A conversation whose first user turn holds `image`, each later turn text only, every
    turn sent whole as an agent sends it."""
    messages: list[dict] = []
    replies = []
    for i, text in enumerate(turns):
        content: list[dict] = [{"type": "text", "text": text}]
        if i == 0:
            content.append({"type": "image_url", "image_url": {"url": data_url(image)}})
        messages.append({"role": "user", "content": content})
        body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        replies.append(r.json())
        messages.append({"role": "assistant", "content": answer(r.json())})
    return replies


def test_an_image_conversation_reuses_its_prefix_across_a_restart(
    model_dir: Path, client: TestClient, tmp_path: Path
) -> None:
    """The prompt cache keys the image by its pixels: turn 2 on reuses at least 90% of the
    turn before, also after a restart, where the tower does not run again (its features come
    from the cache's directory); every answer is the cache-less server's."""
    turns = ["What is in the picture?", "And its colour?", "Say it again."]
    want = [answer(r) for r in converse(client, RED, turns)]
    with cached_client(model_dir, tmp_path) as first:
        replies = converse(first, RED, turns[:2])
        assert first.app.state.pool.slots[0].engine.vision.encoded == 1
    assert [answer(r) for r in replies] == want[:2]
    previous = replies[0]["usage"]["prompt_tokens"]
    cached = replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * previous
    with cached_client(model_dir, tmp_path) as restarted:
        again = converse(restarted, RED, turns)
        # Another text before the same image: its KV cannot be reused, its features are.
        chat(restarted, RED, "Something else entirely?")
        assert restarted.app.state.pool.slots[0].engine.vision.encoded == 0
    assert [answer(r) for r in again] == want
    for before, reply in zip(again, again[1:], strict=False):
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * before["usage"]["prompt_tokens"]


def test_another_image_in_the_same_place_never_reuses_the_first_ones_kv(
    model_dir: Path, client: TestClient, tmp_path: Path
) -> None:
    """Same size, same text, other pixels: the cache reuses the text before the image only,
    and the answer is the cache-less server's (and mlx-vlm's)."""
    text = "What is in the picture?"
    with cached_client(model_dir, tmp_path) as cached:
        chat(cached, RED, text)
        reply = chat(cached, GREEN, text)
    assert answer(reply) == answer(chat(client, GREEN, text))
    assert answer(reply).strip() == reference(model_dir, text, GREEN).strip()
    usage = reply["usage"]
    # none of GREEN's image tokens, nor any after them, came from RED's KV
    assert usage["prompt_tokens_details"]["cached_tokens"] <= (
        usage["prompt_tokens"] - TOKENS_PER_IMAGE - 1
    )


def test_an_images_features_are_kept_by_the_prompt_cache_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    """The prompt cache's features tier is the one place an image's features are kept (counted
    in /v1/cache and the memory ledger): dropped from its RAM, as memory pressure drops them,
    a repeated image's features come from its file, not from another copy, and the tower does
    not run again."""
    with cached_client(model_dir, tmp_path) as c:
        chat(c, RED)
        engine = c.app.state.pool.slots[0].engine
        stats = c.get("/v1/cache").json()
        assert stats["features_ram_entries"] == 1 and stats["features_disk_entries"] == 1
        engine.prompt_cache.flush()
        engine.prompt_cache.features.release_ram(stats["features_ram_bytes"])
        chat(c, RED, "Something else entirely?")  # another text before it: its KV is not reused
        assert c.get("/v1/cache").json()["features_disk_hits"] == 1
        assert engine.vision.encoded == 1


@pytest.mark.parametrize(
    "family", ["gemma3_vision_dir", "qwen2_5_vl_dir", "qwen3_vl_dir", "gemma4_vision_dir"]
)
def test_image_features_come_in_the_dtype_asked_for(tmp_path: Path, family: str) -> None:
    """A tower whose weights are float32 beside a bfloat16 text model (or the other way
    round) gives its features in the text embeddings' dtype: the prompt cache's features tier
    stores them so, and a prefill adds them to embeddings of that dtype."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_kvserve.images.pixels import ImageLimits, decode_image
    from mlx_kvserve.vision.encoder import load_vision
    from tests.support import vision_models
    from tests.support.images import encoded

    model_dir = getattr(vision_models, family)(tmp_path / family)
    model, tokenizer = load(str(model_dir))
    vision = load_vision(model_dir, tokenizer.convert_ids_to_tokens, model)
    assert vision is not None
    image = decode_image(
        encoded("PNG", 64, 64, (230, 200, 20)), ImageLimits(1 << 24, 1 << 24), "image"
    )
    for dtype in (mx.bfloat16, mx.float32, mx.float16):
        assert vision.family.features(image, dtype).dtype == dtype, (family, dtype)
