"""Hostile embedding bodies for `/v1/embeddings`, `/api/embed` and `/api/embeddings`
(tests/clients/test_embeddings.py, test_encoder_embeddings.py): inputs of every shape (texts,
token ids out of range, nested lists, nulls), odd `dimensions`, `encoding_format`, `truncate`,
`keep_alive` and `options`, or bytes that are not JSON."""

from __future__ import annotations

import json

from hypothesis import strategies as st

TOKEN_IDS = st.lists(st.integers(-3, 70_000), max_size=6)
INPUTS = st.one_of(
    st.text(max_size=40),
    st.lists(st.text(max_size=20), max_size=5),
    TOKEN_IDS,
    st.lists(TOKEN_IDS, max_size=4),
    st.integers(),
    st.none(),
    st.lists(st.one_of(st.text(max_size=5), st.integers(), st.none()), max_size=4),
)
OPTIONAL = st.one_of(st.none(), st.integers(-5, 100), st.text(max_size=8), st.booleans())


@st.composite
def embedding_body(draw: st.DrawFn, path: str, models: list) -> bytes:
    """A body for `path` naming one of `models`: odd inputs and options, or not JSON at all."""
    body: dict = {"model": draw(st.sampled_from(models))}
    key = "prompt" if path == "/api/embeddings" else "input"
    body[key] = draw(INPUTS)
    for field in ("dimensions", "encoding_format", "truncate", "keep_alive", "options", "user"):
        if draw(st.booleans()):
            body[field] = draw(
                st.one_of(
                    OPTIONAL,
                    st.sampled_from(["float", "base64"]),
                    st.dictionaries(
                        st.sampled_from(["num_ctx", "temperature", "x"]), OPTIONAL, max_size=2
                    ),
                )
            )
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=30))  # not JSON at all
    return json.dumps(body).encode()


PATHS = ["/v1/embeddings", "/api/embed", "/api/embeddings"]
