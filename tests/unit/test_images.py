"""Images read the one way for every protocol: decoded from their bytes under the caps, URLs
fetched only where allowed and never from a private address (mlx_kvserve/images)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.chat import InvalidRequest, Message
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.images.fetch import Fetcher
from mlx_kvserve.images.note import note, noted_text
from mlx_kvserve.images.pixels import ImageLimits, ImageRefused, decode_image
from mlx_kvserve.images.reader import ImageReader
from tests.support.images import SVG, b64, data_url, encoded, huge_png, image_server

LIMITS = ImageLimits()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_the_format_is_read_from_the_bytes(fmt: str) -> None:
    image = decode_image(encoded(fmt, 30, 20), LIMITS, "x")
    assert (image.format, image.width, image.height) == (fmt.lower(), 30, 20)


def test_a_mislabelled_image_is_what_its_bytes_say() -> None:
    png = encoded("PNG")
    image = ImageReader().from_url(data_url(png, "image/jpeg"), "f")
    assert image.format == "png"


def test_the_digest_is_the_pixels_not_the_encoding() -> None:
    """The same pixels as PNG and as lossless WebP are one image; other pixels are another."""
    reader = ImageReader()
    png = reader.from_base64(b64(encoded("PNG")), "a")
    webp = reader.from_url(data_url(encoded("WEBP", lossless=True), "image/webp"), "b")
    other = decode_image(encoded("PNG", color=(0, 255, 0)), LIMITS)
    assert png.digest == webp.digest != other.digest
    assert png.format != webp.format


@pytest.mark.parametrize(
    "data, why",
    [
        (b"hello, not an image", "not an image"),
        (encoded("PNG")[:60], "truncated"),
        (huge_png(), "pixels"),
        (SVG, "SVG"),
        (encoded("BMP"), "not an image"),
        (b"", "empty"),
    ],
    ids=["text", "truncated-png", "20000x20000", "svg", "bmp", "empty"],
)
def test_bad_bytes_are_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(ImageRefused, match=why):
        decode_image(data, LIMITS)


def test_the_caps_are_the_settings() -> None:
    png = encoded("PNG", 64, 40)
    with pytest.raises(ImageRefused, match="byte cap"):
        decode_image(png, ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(ImageRefused, match="pixel cap"):
        decode_image(png, ImageLimits(max_pixels=64 * 40 - 1))
    assert decode_image(png, ImageLimits(max_bytes=len(png), max_pixels=64 * 40)).width == 64


@pytest.mark.parametrize(
    "url", ["data:image/png,abc", "data:image/png;base64,%%%", "ftp://x/y.png", "file:///etc/x"]
)
def test_a_bad_url_names_the_field(url: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ImageReader().from_url(url, "messages[0].content[1].image_url")
    assert refused.value.param == "messages[0].content[1].image_url"


def test_urls_are_refused_unless_allowed_and_nothing_is_fetched() -> None:
    with image_server(encoded("PNG")) as server:
        with pytest.raises(InvalidRequest, match="image URLs are off"):
            ImageReader().from_url(server.url("/image.png"), "f")
        assert server.hits == []


def test_an_allowed_url_is_fetched_through_the_test_seam() -> None:
    png = encoded("PNG", 50, 30)
    with image_server(png) as server:
        fetcher = Fetcher(("127.0.0.1",), trusted=frozenset({("127.0.0.1", server.port)}))
        image = ImageReader(fetcher=fetcher).from_url(server.url("/image.png"), "f")
        assert (image.width, image.height, server.hits) == (50, 30, ["/image.png"])
        redirected = ImageReader(fetcher=fetcher).from_url(
            server.url("/redirect?to=/image.png"), "f"
        )
        assert redirected.digest == image.digest


def test_loopback_is_private_without_the_seam() -> None:
    with image_server(encoded("PNG")) as server:
        fetcher = Fetcher(("127.0.0.1",))
        with pytest.raises(InvalidRequest, match="private"):
            ImageReader(fetcher=fetcher).from_url(server.url("/image.png"), "f")
        assert server.hits == []


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/",  # link-local: the cloud metadata service
        "http://10.0.0.1/x.png",
        "http://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://127.0.0.1:{other}/image.png",  # loopback on a port the seam does not trust
    ],
)
def test_a_redirect_to_a_private_address_is_refused_before_it_is_fetched(target: str) -> None:
    with image_server(encoded("PNG")) as server, image_server(encoded("PNG")) as other:
        hosts = ("127.0.0.1", "169.254.169.254", "10.0.0.1", "::1", "::ffff:127.0.0.1")
        fetcher = Fetcher(hosts, trusted=frozenset({("127.0.0.1", server.port)}))
        url = server.url("/redirect?to=" + target.format(other=other.port))
        with pytest.raises(InvalidRequest, match="private"):
            ImageReader(fetcher=fetcher).from_url(url, "f")
        assert other.hits == [] and len(server.hits) == 1


def test_a_host_off_the_allowlist_is_refused_at_every_hop() -> None:
    with image_server(encoded("PNG")) as server:
        fetcher = Fetcher(("127.0.0.1",), trusted=frozenset({("127.0.0.1", server.port)}))
        url = server.url("/redirect?to=http://images.example/x.png")
        with pytest.raises(InvalidRequest, match="not on this server's --image-urls list"):
            ImageReader(fetcher=fetcher).from_url(url, "f")


def test_the_byte_cap_holds_for_a_fetched_image() -> None:
    png = encoded("PNG", 200, 200)
    with image_server(png) as server:
        trusted = frozenset({("127.0.0.1", server.port)})
        fetcher = Fetcher(("127.0.0.1",), max_bytes=len(png) - 1, trusted=trusted)
        with pytest.raises(InvalidRequest, match="over the cap"):
            ImageReader(fetcher=fetcher).from_url(server.url("/image.png"), "f")


def test_the_note_is_the_same_every_time_and_keeps_the_text_around_it() -> None:
    image = decode_image(encoded("PNG", 1280, 800), LIMITS)
    assert note(image) == "[image: PNG 1280x800, not shown: this model does not see images]"
    message = Message.from_parts("user", ["Look:", image, "what is it?"])
    assert message.content == "Look:what is it?" and message.images == [image]
    assert noted_text(message.parts) == f"Look:\n{note(image)}\nwhat is it?"
    assert noted_text([image]) == note(image)
    assert Message.from_parts("user", ["a", "b"]).parts == ()


def test_the_image_settings_come_from_flags_environment_and_the_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlx_kvserve.api.images import make_image_reader
    from mlx_kvserve.config.precedence import load_settings
    from mlx_kvserve.config.values import check_value

    config = tmp_path / "config.toml"
    config.write_text('images = "reject"\nimage_urls = ["a.example", "*.b.example"]\n')
    monkeypatch.setenv("MLX_KVSERVE_MAX_IMAGE_PIXELS", "1000")
    settings = load_settings({"image_url_timeout": 2.5}, config)
    assert settings.images == "reject" and settings.image_urls == ["a.example", "*.b.example"]
    reader = make_image_reader(settings)
    assert reader.limits.max_pixels == 1000 and reader.fetcher.timeout == 2.5
    assert reader.fetcher.hosts == ("a.example", "*.b.example")
    assert Settings().images == "note" and Settings().image_urls == []  # URLs off by default
    with pytest.raises(ValueError, match="note, reject"):
        check_value("images", "drop")
    with pytest.raises(ValueError, match="positive"):
        check_value("max_image_pixels", 0)


def test_a_model_that_sees_images_gets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam a vision backend plugs into: `Slot.sees_images` True passes the images on."""
    from mlx_kvserve.api.images import for_model
    from mlx_kvserve.chat import ChatRequest
    from mlx_kvserve.models.pool import Slot

    image = decode_image(encoded("PNG"), LIMITS, "messages[0].content[1]")
    chat = ChatRequest([Message.from_parts("user", ["Look:", image])])
    slot = Slot.__new__(Slot)  # no model behind it: only what for_model reads
    monkeypatch.setattr(Slot, "name", property(lambda self: "m"))
    assert for_model(chat, slot, "note").messages[0].content == "Look:\n" + note(image)
    with pytest.raises(APIError, match="'m' does not see images") as refused:
        for_model(chat, slot, "reject")
    assert refused.value.param == "messages[0].content[1]"
    monkeypatch.setattr(Slot, "sees_images", property(lambda self: True))
    assert for_model(chat, slot, "reject") is chat


def test_a_fetch_that_drips_past_its_deadline_is_cut_off() -> None:
    """Each byte arrives within any socket timeout; the whole fetch still has its deadline."""
    with image_server(encoded("PNG")) as server:
        trusted = frozenset({("127.0.0.1", server.port)})
        fetcher = Fetcher(("127.0.0.1",), timeout=0.5, trusted=trusted)
        with pytest.raises(InvalidRequest, match="took over 0.5 s"):
            ImageReader(fetcher=fetcher).from_url(server.url("/slow"), "f")
        assert server.drip_ended.wait(30)
        assert server.dripped < 100  # the connection was cut, not left to finish


def test_an_image_sent_again_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents resend the conversation's images every turn: the same bytes are decoded once
    (keyed by their hash, each use keeping its own field), other bytes again; a URL is still
    fetched every time."""
    import mlx_kvserve.images.reader as reader_module

    decoded: list[str] = []

    def counting(data: bytes, limits: ImageLimits, origin: str = ""):
        decoded.append(origin)
        return decode_image(data, limits, origin)

    monkeypatch.setattr(reader_module, "decode_image", counting)
    reader = ImageReader()
    png = encoded("PNG")
    first = reader.from_base64(b64(png), "turn1")
    again = reader.from_url(data_url(png), "turn2")
    other = reader.from_base64(b64(encoded("PNG", color=(1, 2, 3))), "other")
    assert decoded == ["turn1", "other"]
    assert (again.digest, again.origin, first.origin) == (first.digest, "turn2", "turn1")
    assert other.digest != first.digest
    with image_server(png) as server:
        trusted = frozenset({("127.0.0.1", server.port)})
        fetching = ImageReader(fetcher=Fetcher(("127.0.0.1",), trusted=trusted))
        for _ in range(2):
            fetching.from_url(server.url("/image.png"), "f")
        assert server.hits == ["/image.png"] * 2


def test_https_speaks_to_the_host_at_the_checked_address() -> None:
    """Over TLS the fetch connects to the address that was checked and names the URL's host
    (SNI, certificate, Host header); a certificate for another name is refused."""
    import ssl

    import trustme

    authority = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("images.test").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    authority.configure_trust(client_tls)
    with image_server(encoded("PNG", 12, 34), tls=server_tls) as server:
        for name, works in (("images.test", True), ("other.test", False)):
            fetcher = Fetcher(
                (name,),
                trusted=frozenset({("127.0.0.1", server.port)}),
                resolver=lambda host, port: ["127.0.0.1"],
                tls=client_tls,
            )
            url = f"https://{name}:{server.port}/image.png"
            if works:
                image = ImageReader(fetcher=fetcher).from_url(url, "f")
                assert (image.width, image.height) == (12, 34)
                assert server.hosts == [f"images.test:{server.port}"]
            else:
                with pytest.raises(InvalidRequest, match="could not be fetched"):
                    ImageReader(fetcher=fetcher).from_url(url, "f")


def test_any_url_is_a_refusal_naming_the_field_never_an_error() -> None:
    """URLs of every shape through a fetcher that allows every host (its resolver answers a
    private address, so nothing is ever connected to)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fetcher = Fetcher(("*",), resolver=lambda host, port: ["10.9.8.7"])
    reader = ImageReader(fetcher=fetcher)
    hosts = st.one_of(
        st.text(max_size=12), st.sampled_from(["ex ample", "a\x00b", "xn--", "ü.example", "[::1"])
    )
    ports = st.one_of(
        st.just(""), st.integers(-5, 99999).map(lambda p: f":{p}"), st.text(max_size=4)
    )
    urls = st.one_of(
        st.builds(
            lambda scheme, host, port, path: f"{scheme}://{host}{port}/{path}",
            st.sampled_from(["http", "https", "HTTP", "ftp", "javascript"]),
            hosts,
            ports,
            st.text(max_size=10),
        ),
        st.text(max_size=30),
    )

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(url=urls)
    def probe(url: str) -> None:
        with pytest.raises(InvalidRequest) as refused:
            reader.from_url(url, "input[0].content[0].image_url")
        assert refused.value.param == "input[0].content[0].image_url"

    probe()


def test_images_with_bytes_changed_anywhere_are_read_or_refused() -> None:
    """Real images of every format with bytes overwritten, cut or spliced: an Image or an
    ImageRefused, never another error (Pillow's parsers meet hostile input here)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    originals = [encoded(fmt, 17, 9) for fmt in ("PNG", "JPEG", "GIF", "WEBP")]

    @st.composite
    def mangled(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(st.sampled_from(originals)))
        for _ in range(draw(st.integers(1, 6))):
            at = draw(st.integers(0, len(data) - 1))
            data[at : at + 4] = draw(st.binary(min_size=0, max_size=4))
        return bytes(data)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=mangled())
    def probe(data: bytes) -> None:
        with contextlib.suppress(ImageRefused):
            decode_image(data, LIMITS)

    probe()
