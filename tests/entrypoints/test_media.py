"""Images from URLs (:mod:`pagedllm.entrypoints.media`): the same picture gets the same
hash from a data URL, a file, an http URL and a PIL image; every source is refused
outside its limits (allowed folder, domains, time, bytes, pixels) with a message saying
why. The http cases run against a real loopback server."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest
from image_fixtures import SLOW_SECONDS, bomb_png, data_url, image_server, png_bytes
from PIL import Image

from pagedllm.core.configs.model import ModelConfig
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.multimodal import content_hash
from pagedllm.entrypoints.media import MediaConnector, MediaError, MediaLimits

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def base_url():
    with image_server() as url:
        yield url


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "image.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes(color=(1, 2, 3)))
    return root


def connector(root: Path | None = None, **limits) -> MediaConnector:
    return MediaConnector(
        str(root) if root else "", None, MediaLimits(**{"fetch_timeout": TIMEOUT, **limits})
    )


def refused(fn, *args, match: str) -> str:
    with pytest.raises(MediaError, match=match) as excinfo:
        fn(*args)
    return str(excinfo.value)


def test_one_hash_for_one_picture_from_every_source(media_dir, base_url):
    media = connector(media_dir)
    loaded = [
        media.load_image(data_url(png_bytes())),
        media.load_image(f"file://{media_dir / 'image.png'}"),
        media.load_image(f"{base_url}/image.png"),
        media.from_pil(Image.new("RGB", (5, 4), (200, 30, 90))),
    ]
    assert {item.hash for item in loaded} == {loaded[0].hash}
    for item in loaded:
        assert item.image.mode == "RGB" and item.image.size == (5, 4)
        assert item.image.getpixel((0, 0)) == (200, 30, 90)
    other = media.load_image(data_url(png_bytes(color=(200, 30, 91))))
    assert other.hash != loaded[0].hash
    assert content_hash(Image.new("RGB", (4, 5), (200, 30, 90))) != loaded[0].hash


def test_transparency_becomes_white_and_other_modes_rgb():
    media = connector()
    clear = media.load_image(data_url(png_bytes(color=(0, 0, 0, 0))))
    assert clear.image.mode == "RGB" and clear.image.getpixel((0, 0)) == (255, 255, 255)
    grey = media.from_pil(Image.new("L", (2, 2), 7))
    assert grey.image.mode == "RGB" and grey.image.getpixel((1, 1)) == (7, 7, 7)


def test_data_urls_that_are_not_images(base_url):
    media = connector()
    refused(media.load_image, data_url(b"GIF87a but not really"), match="not an image")
    refused(media.load_image, data_url(b"hello", "text/plain"), match="data:image/<type>;base64")
    refused(media.load_image, "data:image/png,rawbytes", match="data:image/<type>;base64")
    refused(media.load_image, "data:image/png;base64,@@@@", match="not valid base64")
    refused(media.load_image, data_url(png_bytes()[:40]), match="not an image|cannot be decoded")
    refused(media.load_image, f"{base_url}/text", match="not an image")
    refused(media.load_image, "ftp://example.com/a.png", match="scheme 'ftp' is not supported")
    refused(media.load_image, "", match="non-empty string")


def test_a_decompression_bomb_is_refused_from_its_header():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    message = refused(connector().load_image, data_url(bomb_png()), match="more pixels")
    # (7.5 GB of RGB pixels if it were decoded: refused at once, the memory never taken)
    assert time.monotonic() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB
    assert "PAGEDLLM_MAX_IMAGE_PIXELS" in message
    # (one past the limit but under PIL's own bound: refused by the claimed size too)
    message = refused(connector().load_image, data_url(bomb_png(10_000, 9_000)), match="more")
    assert "(10000x9000)" in message
    small_limit = connector(max_pixels=19)
    refused(small_limit.load_image, data_url(png_bytes((5, 4))), match=r"\(5x4\)")
    refused(small_limit.from_pil, Image.new("RGB", (5, 4)), match="more pixels")
    assert connector(max_pixels=20).load_image(data_url(png_bytes((5, 4)))).image.size == (5, 4)


def test_file_urls_only_inside_the_allowed_folder(media_dir, tmp_path):
    secret = tmp_path / "secret.png"
    refused(connector().load_image, f"file://{media_dir / 'image.png'}", match="not started with")
    media = connector(media_dir)
    refused(media.load_image, f"file://{secret}", match="outside --allowed-local-media-path")
    refused(media.load_image, f"file://{media_dir}/../secret.png", match="outside")
    refused(media.load_image, f"file://{media_dir}/%2e%2e/secret.png", match="outside")
    (media_dir / "escape.png").symlink_to(secret)
    refused(media.load_image, f"file://{media_dir / 'escape.png'}", match="outside")
    (media_dir / "link.png").symlink_to(media_dir / "image.png")  # (inside: fine)
    assert media.load_image(f"file://{media_dir / 'link.png'}").image.size == (5, 4)
    refused(media.load_image, "file://other-host/etc/passwd", match="path on the server")
    refused(media.load_image, f"file://{media_dir / 'missing.png'}", match="cannot read")
    refused(media.load_image, f"file://{media_dir}", match="not a regular file")
    os.mkfifo(media_dir / "fifo")  # (must not block the open)
    refused(media.load_image, f"file://{media_dir / 'fifo'}", match="not a regular file")
    (media_dir / "big.png").write_bytes(png_bytes() + b"\0" * 5000)
    refused(
        connector(media_dir, max_bytes=4000).load_image,
        f"file://{media_dir / 'big.png'}",
        match="larger than",
    )


def test_the_connector_takes_its_options_from_the_model_config(media_dir):
    media = MediaConnector.from_config(
        ModelConfig(allowed_local_media_path=str(media_dir), allowed_media_domains=["Example.COM"])
    )
    assert media.root == os.path.realpath(media_dir)
    assert media.domains == ["example.com"]
    assert MediaConnector.from_config(ModelConfig()).root is None
    with pytest.raises(ConfigError, match="--allowed-local-media-path.*not an existing directory"):
        ModelConfig(allowed_local_media_path=str(media_dir / "nope"))
    with pytest.raises(ConfigError, match="'https://x.org' is not a host name"):
        ModelConfig(allowed_media_domains=["https://x.org"])


def test_http_fetches_are_bounded_in_time(base_url):
    media = connector()
    for route in ("slow", "drip"):
        started = time.monotonic()
        refused(media.load_image, f"{base_url}/{route}", match="took longer than 1 s")
        assert time.monotonic() - started < SLOW_SECONDS, route


def test_http_fetches_are_bounded_in_size(base_url):
    media = connector(max_bytes=100_000)
    refused(media.load_image, f"{base_url}/large", match="larger than")
    refused(media.load_image, f"{base_url}/large-chunked", match="larger than")
    refused(media.load_image, f"{base_url}/missing", match="answered HTTP 404")
    refused(media.load_image, "http://[::1", match="invalid")


def test_allowed_media_domains(base_url):
    port = base_url.rpartition(":")[2]
    media = MediaConnector("", ["localhost"], MediaLimits(fetch_timeout=TIMEOUT))
    assert media.load_image(f"http://localhost:{port}/image.png").image.size == (5, 4)
    refused(media.load_image, f"{base_url}/image.png", match="'127.0.0.1' is not in")
    # A redirect is followed only to an allowed host.
    refused(
        media.load_image,
        f"http://localhost:{port}/redirect?to={base_url}/image.png",
        match="'127.0.0.1' is not in --allowed-media-domains",
    )
    sub = MediaConnector("", ["host"], MediaLimits(fetch_timeout=TIMEOUT))
    refused(sub.load_image, f"http://localhost:{port}/image.png", match="not in")


def test_limits_from_the_environment():
    assert MediaLimits.from_env({}) == MediaLimits()
    limits = MediaLimits.from_env(
        {
            "PAGEDLLM_IMAGE_FETCH_TIMEOUT": "0.5",
            "PAGEDLLM_MAX_IMAGE_MB": "1.5",
            "PAGEDLLM_MAX_IMAGE_PIXELS": "1000",
        }
    )
    assert limits == MediaLimits(0.5, int(1.5 * (1 << 20)), 1000)
    for name in ("PAGEDLLM_IMAGE_FETCH_TIMEOUT", "PAGEDLLM_MAX_IMAGE_MB"):
        for value in ("0", "-1", "soon"):
            with pytest.raises(ConfigError, match=f"{name}='{value}'"):
                MediaLimits.from_env({name: value})
