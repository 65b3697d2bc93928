"""Images from URLs: ``data:`` URLs, ``file://`` paths under ``--allowed-local-media-path``
and ``http(s)://`` URLs (``--allowed-media-domains``), decoded into RGB PIL images with
their content hash.

Each source is bounded before it costs much: a fetch stops after
``PAGEDLLM_IMAGE_FETCH_TIMEOUT`` seconds (default 5, as vLLM's
``VLLM_IMAGE_FETCH_TIMEOUT``) and at ``PAGEDLLM_MAX_IMAGE_MB`` MiB (default 20), a file
or data URL past that size is refused unread, and an image whose header claims more
than ``PAGEDLLM_MAX_IMAGE_PIXELS`` pixels (default PIL's 89,478,485) is refused before
its pixels are decoded. Loading blocks: the server runs it on a media thread
(:meth:`MediaConnector.load_image_async`), off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import functools
import io
import os
import stat
import time
import urllib.parse
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.core.env import env_number
from pagedllm.core.interfaces.multimodal import content_hash

if TYPE_CHECKING:
    from pagedllm.core.configs.model import ModelConfig

FETCH_TIMEOUT_VARIABLE = "PAGEDLLM_IMAGE_FETCH_TIMEOUT"
MAX_BYTES_VARIABLE = "PAGEDLLM_MAX_IMAGE_MB"
MAX_PIXELS_VARIABLE = "PAGEDLLM_MAX_IMAGE_PIXELS"
# The image formats decoded (PIL's names); other bytes are "not an image".
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_MAX_REDIRECTS = 3
# Threads loading images (each fetch is bounded in time, so a few slow URLs only delay
# other images).
MEDIA_WORKERS = 8


class MediaError(ValueError):
    """A media URL or its content the server refuses; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedImage:
    """A decoded RGB image and :func:`~pagedllm.core.interfaces.multimodal.content_hash`
    of it (the key the engine caches it under)."""

    image: Any  # PIL.Image.Image
    hash: str


_FETCH_TIMEOUT = 5.0
_MAX_MB = 20
# (PIL's own Image.MAX_IMAGE_PIXELS, which warns beyond it and refuses beyond twice it)
_MAX_PIXELS = 89_478_485


@dataclasses.dataclass(frozen=True, slots=True)
class MediaLimits:
    fetch_timeout: float = _FETCH_TIMEOUT
    max_bytes: int = _MAX_MB << 20
    max_pixels: int = _MAX_PIXELS

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> MediaLimits:
        """The limits the environment sets (the defaults where it sets none)."""
        timeout = _positive(env, FETCH_TIMEOUT_VARIABLE, "seconds", _FETCH_TIMEOUT)
        megabytes = _positive(env, MAX_BYTES_VARIABLE, "MiB", _MAX_MB)
        pixels = _positive(env, MAX_PIXELS_VARIABLE, "pixels", _MAX_PIXELS)
        return cls(timeout, int(megabytes * (1 << 20)), int(pixels))


def _positive(env: Mapping[str, str], name: str, unit: str, default: float) -> float:
    return env_number(
        name,
        default,
        f"a number of {unit} above 0",
        parse=float,
        minimum=0.0,
        exclusive=True,
        env=env,
    )


class MediaConnector:
    """Loads images from URLs within the server's media options and limits."""

    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_media_domains: list[str] | None = None,
        limits: MediaLimits | None = None,
    ) -> None:
        self.root = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
        self.domains = allowed_media_domains
        self.limits = limits or MediaLimits()

    @classmethod
    def from_config(cls, model_config: ModelConfig) -> MediaConnector:
        return cls(
            model_config.allowed_local_media_path,
            model_config.allowed_media_domains,
            MediaLimits.from_env(),
        )

    @functools.cached_property
    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        # (its own threads: slow fetches must not hold the event loop's default executor,
        # which builds other requests' responses)
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=MEDIA_WORKERS, thread_name_prefix="pagedllm-media"
        )

    async def load_image_async(self, url: str) -> LoadedImage:
        """:meth:`load_image` on a media thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.load_image, url)

    async def from_pil_async(self, image: Any) -> LoadedImage:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.from_pil, image)

    def load_image(self, url: str) -> LoadedImage:
        """The image at ``url``; :class:`MediaError` says why not."""
        return self.decode(self.read(url))

    def from_pil(self, image: Any) -> LoadedImage:
        """An image given as a PIL image (offline), checked and converted as a URL's is."""
        if not all(hasattr(image, name) for name in ("size", "mode", "convert")):
            raise MediaError(f"expected a PIL image, got {type(image).__name__}")
        self._check_pixels(image.size)
        return _loaded(image)

    # ------------------------------------------------------------------ bytes

    def read(self, url: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise MediaError("the image URL must be a non-empty string")
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            return self._read_data_url(url)
        if scheme == "file":
            return self._read_file(url)
        if scheme in ("http", "https"):
            return self._fetch(url)
        raise MediaError(
            f"the image URL scheme {scheme[:20]!r} is not supported (use data:, file:// or "
            "http(s)://)"
        )

    def _read_data_url(self, url: str) -> bytes:
        header, comma, payload = url[len("data:") :].partition(",")
        media_type, _, encoding = header.partition(";")
        if not comma or encoding.lower() != "base64" or not media_type.startswith("image/"):
            raise MediaError("a data URL must be of the form data:image/<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.limits.max_bytes:
            raise self._too_large()
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's data is not valid base64") from None

    def _read_file(self, url: str) -> bytes:
        if self.root is None:
            raise MediaError(
                "file:// URLs are refused: the server was not started with "
                "--allowed-local-media-path"
            )
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError("a file:// URL names a path on the server (file:///path)")
        path = urllib.parse.unquote(parsed.path)
        # (resolved before anything is opened: ``..`` and symbolic links cannot lead out)
        real = os.path.realpath(path)
        if not os.path.isabs(path) or os.path.commonpath([self.root, real]) != self.root:
            raise MediaError(f"{path!r} is outside --allowed-local-media-path")
        try:
            # (O_NONBLOCK: a FIFO must not hang the open; it is refused below)
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise MediaError(f"cannot read {path!r}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(f"{path!r} is not a regular file")
            if info.st_size > self.limits.max_bytes:
                raise self._too_large()
            data = os.read(fd, self.limits.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.limits.max_bytes:
            raise self._too_large()
        return data

    def _check_host(self, url: Any) -> None:
        host = (url.host or "").lower().rstrip(".")
        if self.domains is not None and not any(
            host == domain or host.endswith("." + domain) for domain in self.domains
        ):
            raise MediaError(
                f"the host {host!r} is not in --allowed-media-domains ({', '.join(self.domains)})"
            )

    def _fetch(self, url: str) -> bytes:
        import httpx

        limits = self.limits
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise MediaError(f"the image URL is invalid: {exc}") from None
        self._check_host(parsed)
        # httpx's timeout bounds each read; the deadline bounds the whole transfer (a
        # server sending a byte at a time), checked between reads: at most twice the limit.
        deadline = time.monotonic() + limits.fetch_timeout
        try:
            with httpx.Client(
                timeout=limits.fetch_timeout,
                follow_redirects=True,
                max_redirects=_MAX_REDIRECTS,
                # (every hop of a redirect is checked against the allowed domains)
                event_hooks={"request": [lambda request: self._check_host(request.url)]},
            ) as client:
                with client.stream("GET", parsed) as response:
                    if response.status_code != 200:
                        raise MediaError(
                            f"fetching the image URL answered HTTP {response.status_code}"
                        )
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limits.max_bytes:
                        raise self._too_large()
                    chunks, size = [], 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > limits.max_bytes:
                            raise self._too_large()
                        if time.monotonic() > deadline:
                            raise httpx.ReadTimeout("deadline", request=response.request)
                        chunks.append(chunk)
        except httpx.TimeoutException:
            raise MediaError(
                f"fetching the image URL took longer than {limits.fetch_timeout:g} s "
                f"({FETCH_TIMEOUT_VARIABLE})"
            ) from None
        except httpx.HTTPError as exc:
            raise MediaError(f"fetching the image URL failed: {exc}") from None
        return b"".join(chunks)

    def _too_large(self) -> MediaError:
        return MediaError(
            f"the image is larger than {self.limits.max_bytes / (1 << 20):.3g} MiB "
            f"({MAX_BYTES_VARIABLE})"
        )

    # ----------------------------------------------------------------- pixels

    def decode(self, data: bytes) -> LoadedImage:
        """``data`` decoded: refused if it is not an image of :data:`FORMATS` or if its
        header claims more pixels than the limit (checked before decoding)."""
        from PIL import Image, UnidentifiedImageError

        try:
            with warnings.catch_warnings():
                # (the pixel limit is checked below; PIL's own only for its error)
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise self._too_many_pixels(None) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            raise MediaError(f"the data is not an image ({', '.join(FORMATS)})") from None
        self._check_pixels(image.size)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise MediaError(f"the image cannot be decoded: {exc}") from None
        return _loaded(image)

    def _check_pixels(self, size: tuple[int, int]) -> None:
        width, height = size
        if width * height > self.limits.max_pixels:
            raise self._too_many_pixels(size)

    def _too_many_pixels(self, size: tuple[int, int] | None) -> MediaError:
        claimed = f" ({size[0]}x{size[1]})" if size else ""
        return MediaError(
            f"the image has more pixels{claimed} than the limit of {self.limits.max_pixels} "
            f"({MAX_PIXELS_VARIABLE})"
        )


def _loaded(image: Any) -> LoadedImage:
    rgb = _as_rgb(image)
    return LoadedImage(rgb, content_hash(rgb))


def _as_rgb(image: Any) -> Any:
    """RGB, with transparent pixels on white (as vLLM converts them)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
