"""A Gemma 4 vision checkpoint sees images: its text model is mlx-lm's, its tower and embedder
mlx-vlm's, and the answer to an image prompt is the one mlx-vlm's own forward gives on the same
weights (docs/images.md, "Gemma 4"): images of any aspect ratio (a variable number of soft
tokens), per-layer inputs of the image tokens, and bidirectional attention within an image.
Real app and engine in this process, a tiny random-weight checkpoint
(tests/support/vision_models.py: `gemma4_vision_dir`), real PNGs made with Pillow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.support.concurrently import concurrently
from tests.support.images import data_url, encoded
from tests.support.in_process import serve_vision
from tests.unit.test_vision import answer

pytest.importorskip("mlx_vlm")

WIDE = encoded("PNG", 64, 40, (200, 30, 30))  # 15 soft tokens
GREEN = encoded("PNG", 64, 40, (20, 220, 40))  # WIDE's size: only the pixels differ
SQUARE = encoded("PNG", 30, 30, (30, 30, 200))  # 16 soft tokens
TALL = encoded("PNG", 20, 90, (120, 200, 10))  # a narrow one: 8
TOKENS = 8
TEXT = "What is in the picture?"
NO_THINKING = {"enable_thinking": False}  # as mlx-vlm renders the template


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.vision_models import gemma4_vision_dir

    return gemma4_vision_dir(tmp_path_factory.mktemp("vision") / "gemma4")


def app(model_dir: Path, **engine: object) -> TestClient:
    return serve_vision(model_dir, "tiny-gemma4", **engine)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with app(model_dir, cache_enabled=False) as c:
        yield c


def content(image: bytes | list[bytes] | None, text: str = TEXT) -> list[dict]:
    """The images first, then the text: the order mlx-vlm's chat template puts them in."""
    images = [] if image is None else image if isinstance(image, list) else [image]
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [*parts, {"type": "text", "text": text}]


def chat(client: TestClient, image: bytes | list[bytes] | None, text: str = TEXT) -> dict:
    body = {
        "messages": [{"role": "user", "content": content(image, text)}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template_kwargs": NO_THINKING,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def reference(model_dir: Path, text: str, image: bytes | list[bytes]) -> tuple[str, list[int]]:
    """mlx-vlm's own answer and prompt on the same checkpoint, nothing of ours: its chat
    template and processor (tokens, pixels, `mm_token_type_ids`), its `get_input_embeddings`
    (the per-layer inputs with them) and language model over the whole prompt at once, as its
    `generate_step` runs Gemma 4 with an image (no chunks), greedy over the tokenizer's ids."""
    import io
    import json

    import mlx.core as mx
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image as PILImage

    model = load_model(model_dir)  # first, as mlx-vlm's `load`: it registers its processor
    processor = load_processor(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    images = image if isinstance(image, list) else [image]
    prompt = apply_chat_template(processor, config, text, num_images=len(images))
    pictures = [PILImage.open(io.BytesIO(i)).convert("RGB") for i in images]
    inputs = processor(text=[prompt], images=pictures, add_special_tokens=False)
    ids = mx.array(inputs["input_ids"])
    kinds = mx.array(inputs["mm_token_type_ids"])
    pixels = inputs["pixel_values"]  # a list when the images' sizes differ: the tower takes it
    pixels = pixels if isinstance(pixels, list) else mx.array(pixels)
    embedded = model.get_input_embeddings(ids, pixels)
    cache = model.language_model.make_cache()
    logits = model.language_model(
        ids,
        inputs_embeds=embedded.inputs_embeds,
        per_layer_inputs=embedded.per_layer_inputs,
        mm_token_type_ids=kinds,
        cache=cache,
    ).logits
    size = len(processor.tokenizer)
    out: list[int] = []
    for _ in range(TOKENS):
        token = int(mx.argmax(logits[0, -1, :size]).item())
        out.append(token)
        logits = model.language_model(mx.array([[token]]), cache=cache).logits
    return processor.tokenizer.decode(out), [int(t) for t in inputs["input_ids"][0]]


@pytest.mark.parametrize("image", [WIDE, SQUARE, TALL], ids=["wide", "square", "tall"])
def test_the_answer_to_an_image_is_mlx_vlms(
    client: TestClient, model_dir: Path, image: bytes
) -> None:
    got = chat(client, image)
    want, prompt = reference(model_dir, TEXT, image)
    assert answer(got).strip() == want.strip()  # (the answer's leading space is trimmed)
    assert got["usage"]["prompt_tokens"] == len(prompt)


def test_two_images_in_a_turn_are_mlx_vlms(client: TestClient, model_dir: Path) -> None:
    """Two images of other sizes side by side: two blocks, each seeing only itself both
    ways."""
    got = chat(client, [SQUARE, GREEN])
    want, prompt = reference(model_dir, TEXT, [SQUARE, GREEN])
    assert answer(got).strip() == want.strip()
    assert got["usage"]["prompt_tokens"] == len(prompt)


def test_the_prompt_and_pixels_are_mlx_vlms(model_dir: Path) -> None:
    """A one-turn image prompt renders to the very tokens mlx-vlm's chat template and
    processor make (the image's soft-token count from its size), the image to its pixels."""
    import io
    import json

    import numpy as np
    from mlx_lm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image as PILImage

    from mlx_kvserve.chat import ChatRequest, Message
    from mlx_kvserve.chat.render import render_chat
    from mlx_kvserve.images.pixels import ImageLimits, decode_image
    from mlx_kvserve.vision.encoder import load_vision

    load_model(model_dir)  # first, as mlx-vlm's `load`: it registers its processor
    processor = load_processor(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    prompt = apply_chat_template(processor, config, TEXT, num_images=1)
    _, tokenizer = load(str(model_dir))
    vision = load_vision(model_dir, tokenizer.convert_ids_to_tokens)
    assert vision is not None
    for sent in (WIDE, SQUARE, TALL):
        picture = PILImage.open(io.BytesIO(sent)).convert("RGB")
        theirs = processor(text=[prompt], images=[picture], add_special_tokens=False)
        image = decode_image(sent, ImageLimits(1 << 24, 1 << 24), "image")
        ours = render_chat(
            tokenizer,
            ChatRequest([Message.from_parts("user", [image, TEXT])], template_kwargs=NO_THINKING),
            vision=vision,
        )
        assert ours.tokens == [int(t) for t in theirs["input_ids"][0]]
        assert np.array_equal(vision.family.pixels(image), np.asarray(theirs["pixel_values"]))
        (span,) = ours.image_spans
        assert span.length == vision.family.soft_tokens(image)
        assert ours.tokens[span.start - 1] == config["boi_token_id"]
        assert ours.tokens[span.end] == config["eoi_token_id"]


def test_a_different_image_gives_a_different_answer(client: TestClient) -> None:
    assert answer(chat(client, WIDE)) != answer(chat(client, GREEN))
    assert answer(chat(client, WIDE)) == answer(chat(client, WIDE))


def test_image_and_text_requests_batched_answer_as_alone(client: TestClient) -> None:
    images = [WIDE, None, SQUARE, None, TALL]
    alone = [answer(chat(client, image)) for image in images]
    together = concurrently(lambda image: answer(chat(client, image)), images)
    assert together == alone


def test_the_model_lists_vision(client: TestClient) -> None:
    models = client.get("/v1/models").json()["data"]
    assert "vision" in models[0]["capabilities"]
    shown = client.post("/api/show", json={"model": "tiny-gemma4"}).json()
    assert "vision" in shown["capabilities"]


def test_chunks_never_split_an_image(model_dir: Path) -> None:
    """A prefill step of 3 cuts the text before the image into chunks and would cut the image;
    the image's chunk starts after cached text (its masks carry that offset) and holds it
    whole, and the answer is mlx-vlm's still."""
    with app(model_dir, cache_enabled=False, prefill_step=3) as small_steps:
        got = answer(chat(small_steps, GREEN, "Describe it."))
    want, _ = reference(model_dir, "Describe it.", GREEN)
    assert got.strip() == want.strip()


def converse(
    client: TestClient, image: bytes, turns: list[str], kwargs: dict | None = None
) -> list[dict]:
    """A conversation whose first user turn holds `image`, each later turn text only, every
    turn sent whole as an agent sends it (thinking on, the template's default here, unless
    `kwargs` say otherwise)."""
    messages: list[dict] = []
    replies = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": content(image if i == 0 else None, text)})
        body = {
            "messages": messages,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            **({"chat_template_kwargs": kwargs} if kwargs else {}),
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        replies.append(r.json())
        messages.append({"role": "assistant", "content": answer(r.json())})
    return replies


@pytest.mark.parametrize("kwargs", [None, NO_THINKING], ids=["thinking", "thinking-off"])
def test_a_second_turn_from_the_prompt_cache_answers_as_without_it(
    model_dir: Path, client: TestClient, tmp_path: Path, kwargs: dict | None
) -> None:
    """Turn 2 continues from turn 1's cached KV, image included, and answers as a server
    without a cache does; another image in the same place reuses only the text before it.
    Thinking off, each prompt ends in an empty thought channel the next turn's history drops:
    its sliding windows cannot be cut back, so a checkpoint before that channel serves it."""
    from mlx_kvserve.cache import PromptCache

    turns = [TEXT, "And its colour?", "Say it again."]
    want = [answer(r) for r in converse(client, WIDE, turns, kwargs)]
    cache = PromptCache(tmp_path, "tiny-gemma4", disk_budget=256 << 20, ram_budget=64 << 20)
    with app(model_dir, prompt_cache=cache) as cached:
        replies = converse(cached, WIDE, turns, kwargs)
        (other,) = converse(cached, GREEN, turns[:1], kwargs)
    assert [answer(r) for r in replies] == want
    for before, reply in zip(replies, replies[1:], strict=False):
        reused = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if kwargs:  # all but `<|channel>` `thought` `\n` `<channel|>`, the block it drops
            assert reused == before["usage"]["prompt_tokens"] - 4
        else:
            assert reused >= 0.9 * before["usage"]["prompt_tokens"]
    assert answer(other) == answer(converse(client, GREEN, turns[:1], kwargs)[0])
    # none of GREEN's image tokens, nor any after them, came from WIDE's KV
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 15


@pytest.mark.parametrize(
    "variant",
    ["causal", "per-layer-only", "bidirectional-only", "transformers-layout", "bfloat16"],
)
def test_each_variant_answers_as_mlx_vlm(tmp_path: Path, variant: str) -> None:
    """E2B/E4B (per-layer inputs, causal over images, clipped tower layers) and the larger
    checkpoints (bidirectional within an image, no per-layer inputs), and tensors named as
    transformers saves them, and bfloat16 weights as released (the features' division by
    sqrt(hidden size) and the text model's multiplication round twice): each is mlx-vlm's
    answer."""
    from tests.support.vision_models import gemma4_vision_dir

    flags = {
        "causal": {"bidirectional": False, "per_layer": False},
        "per-layer-only": {"bidirectional": False, "per_layer": True},
        "bidirectional-only": {"bidirectional": True, "per_layer": False},
        "transformers-layout": {"bidirectional": False, "per_layer": True, "hf_layout": True},
        "bfloat16": {"dtype": "bfloat16"},
    }[variant]
    model_dir = gemma4_vision_dir(tmp_path / variant, seed=3, **flags)
    with app(model_dir, cache_enabled=False) as c:
        got = answer(chat(c, SQUARE, "Describe it."))
    want, _ = reference(model_dir, "Describe it.", SQUARE)
    assert got.strip() == want.strip()


@pytest.mark.parametrize(
    "size", [(1, 1), (1, 500), (500, 1), (100, 50), (37, 100), (47, 33), (400, 400)]
)
def test_any_aspect_ratio_is_answered_with_the_processors_count(
    client: TestClient, model_dir: Path, size: tuple[int, int]
) -> None:
    """Pictures of one pixel, a line, wide, tall, odd and large sizes: each is answered, its
    soft-token count (10, 12, 16 here) the one mlx-vlm's processor gives it."""
    import io

    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
    from PIL import Image as PILImage

    from mlx_kvserve.vision.gemma4 import image_processor

    theirs = image_processor(model_dir)
    assert isinstance(theirs, Gemma4ImageProcessor)
    sent = encoded("PNG", *size, (90, 160, 220))
    _, (count,) = theirs.preprocess([PILImage.open(io.BytesIO(sent)).convert("RGB")])
    with_image = chat(client, sent)["usage"]["prompt_tokens"]
    without = chat(client, None)["usage"]["prompt_tokens"]
    # the markup: two newlines, <|image>, the soft tokens, <image|>, two newlines
    assert with_image - without == count + 4


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "responses", "ollama"])
def test_fuzzed_image_fields_on_gemma4(client: TestClient, protocol: str) -> None:
    """Whatever the image field holds, a 200 or a 400 in the protocol's shape: never a 5xx
    (a real image of any size and format reaches the tower)."""
    from tests.unit.test_images_api import fuzz_image_field

    fuzz_image_field(client, protocol, "tiny-gemma4", examples=20)
