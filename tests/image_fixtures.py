"""Images and a loopback image server for the media tests (``test_media.py`` and the
server's image tests)."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image

# How long the slow routes of ImageServer take: past the tests' fetch timeouts.
SLOW_SECONDS = 3.0


def png_of(image: Image.Image) -> bytes:
    """``image`` as PNG bytes."""
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def png_bytes(size: tuple[int, int] = (5, 4), color: tuple[int, ...] = (200, 30, 90)) -> bytes:
    mode = "RGBA" if len(color) == 4 else "RGB"
    return png_of(Image.new(mode, size, color))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 50_000, height: int = 50_000) -> bytes:
    """A few dozen bytes of PNG whose header claims ``width`` x ``height`` pixels (a 1x1
    image's IHDR rewritten, its CRC recomputed): decoding it would need gigabytes."""
    png = png_bytes((1, 1))
    (length,) = struct.unpack(">I", png[8:12])
    assert png[12:16] == b"IHDR"
    header = bytearray(png[16 : 16 + length])
    header[0:8] = struct.pack(">II", width, height)
    chunk = b"IHDR" + bytes(header)
    return png[:12] + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[16 + length + 4 :]


class _Handler(http.server.BaseHTTPRequestHandler):
    image = png_bytes()

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: bytes, content_type: str = "image/png") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        try:
            self._route(self.path)
        except OSError:
            pass  # (the client hung up: what the size and time limits do)

    def _route(self, path: str) -> None:
        if path == "/image.png":
            self._send(self.image)
        elif path == "/text":
            self._send(b"<html>not an image</html>", "text/html")
        elif path == "/slow":  # headers only after the timeout
            time.sleep(SLOW_SECONDS)
            self._send(self.image)
        elif path == "/drip":  # a byte at a time, each within the timeout, all past it
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.image)))
            self.end_headers()
            deadline = time.monotonic() + SLOW_SECONDS
            for i in range(len(self.image)):
                self.wfile.write(self.image[i : i + 1])
                self.wfile.flush()
                time.sleep(0.2)
                if time.monotonic() > deadline:
                    break
        elif path == "/large":  # declares its size
            self._send(self.image + b"\0" * 200_000)
        elif path == "/large-chunked":  # does not: cut off by the bytes read
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(100):
                chunk = b"\0" * 16_384
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", path.partition("=")[2])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@contextmanager
def image_server() -> Iterator[str]:
    """A loopback HTTP server of the routes above; yields its base URL
    (``http://127.0.0.1:PORT``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
