"""Hypothesis strategies for the image fields of every protocol (tests/unit/test_images_api.py):
real small images in every format, bytes that are not images or are cut short, data URLs with
any label and any payload, URLs to anywhere, and any JSON value where the field belongs."""

from __future__ import annotations

import base64

from hypothesis import strategies as st

from tests.support.fuzz_values import anything, text
from tests.support.images import SVG, encoded


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    fmt = draw(st.sampled_from(["PNG", "JPEG", "GIF", "WEBP", "BMP"]))
    data = encoded(fmt, draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    cut = draw(st.one_of(st.integers(0, len(data)), st.none()))
    return data if cut is None else data[:cut]


raw = st.one_of(image_bytes(), image_bytes(), st.binary(max_size=64), st.just(SVG))
b64 = st.one_of(raw.map(lambda d: base64.b64encode(d).decode()), raw.map(repr), text)
data_url = st.builds(
    lambda label, params, data: f"data:{label}{params},{data}",
    st.sampled_from(["image/png", "image/jpeg", "image/svg+xml", "text/plain", "", "IMAGE/PNG"]),
    st.sampled_from([";base64", "", ";charset=utf-8;base64", ";BASE64"]),
    b64,
)
url = st.one_of(
    data_url,
    st.sampled_from(
        [
            "http://127.0.0.1/x.png",
            "https://example.com/a.png",
            "http://169.254.169.254/",
            "file:///etc/passwd",
            "ftp://x/y",
            "",
        ]
    ),
    text,
)


def field(protocol: str) -> st.SearchStrategy:
    """A value for the protocol's image field, well-formed or not."""
    if protocol == "openai":
        detail = st.sampled_from(["auto", "low", "high", "ultra"])
        shaped = st.fixed_dictionaries({"url": url}, optional={"detail": detail})
        return st.one_of(shaped, url, anything)
    if protocol == "anthropic":
        media = st.one_of(st.sampled_from(["image/png", "image/jpeg", "image/webp"]), text)
        based = st.fixed_dictionaries({"type": st.just("base64"), "media_type": media, "data": b64})
        linked = st.fixed_dictionaries({"type": st.just("url"), "url": url})
        return st.one_of(based, linked, anything)
    if protocol == "responses":
        return st.one_of(url, anything)
    return st.one_of(b64, anything)  # Ollama: base64 strings
