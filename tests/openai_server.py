"""Run ``pagedllm serve`` in a subprocess for the server tests (``test_server*.py``)."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import clean_env
from tiny_models import make_checkpoint

BASE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "128", "--disable-log-stats")
START_TIMEOUT = 180.0
# A request's time limit in the clients below: generous, for a slow, shared 2-core machine
# (a cold guided-decoding compile and a few hundred tokens took over a minute in CI).
REQUEST_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Llama checkpoint per test session (shared by the server test modules)."""
    directory = tmp_path_factory.getbasetemp() / "server_tiny_llama"
    if not (directory / "model.safetensors").exists():
        make_checkpoint(directory, "llama")
    return directory


class RemoteServer:
    """``pagedllm serve MODEL --host 127.0.0.1 --port FREE ...`` with its output in a file
    (no ``MODEL`` where it is ``None``: ``--config`` names it; ``base_args`` follow the port).

    ``start()`` returns at once so that several servers can load at the same time;
    ``wait_ready()`` blocks until ``/health`` answers 200.
    """

    def __init__(
        self,
        model: Path | None,
        *args: str,
        log_path: Path,
        base_args: tuple[str, ...] = BASE_ARGS,
        env: dict[str, str] | None = None,
        tls_ca: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.port = free_port()
        self.scheme = "https" if tls_ca is not None else "http"
        self.verify: Any = True
        if tls_ca is not None:
            self.verify = ssl.create_default_context(cafile=str(tls_ca))
        self.api_key = api_key
        self.log_path = log_path
        self.command = [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli.main",
            "serve",
            *([] if model is None else [str(model)]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *base_args,
            *args,
        ]
        self.env = env if env is not None else clean_env()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> RemoteServer:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> RemoteServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_text()}"
                )
            try:
                if (
                    httpx.get(self.url + "/health", verify=self.verify, timeout=2).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, **kwargs: Any) -> httpx.Client:
        headers = dict(kwargs.pop("headers", {}))
        if self.api_key is not None:
            headers.setdefault("Authorization", f"Bearer {self.api_key}")
        kwargs.setdefault("timeout", REQUEST_TIMEOUT)
        return httpx.Client(base_url=self.url, verify=self.verify, headers=headers, **kwargs)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", REQUEST_TIMEOUT)
        kwargs.setdefault("base_url", self.url + "/v1")
        return openai.OpenAI(http_client=httpx.Client(verify=self.verify), **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", REQUEST_TIMEOUT)
        kwargs.setdefault("base_url", self.url + "/v1")
        return openai.AsyncOpenAI(http_client=httpx.AsyncClient(verify=self.verify), **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples as ``{'name{labels}': value}`` (label order as served)."""
        text = httpx.get(self.url + "/metrics", verify=self.verify, timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total, found = 0.0, False
        for key, value in self.metrics().items():
            match = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            assert match is not None
            if match.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total, found = total + value, True
        assert found, f"{name}{labels} is not in /metrics"
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_servers(*servers: RemoteServer) -> None:
    """Start ``servers`` together and wait for each (stopping all if one fails)."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def assert_openai_error(response: httpx.Response, status: int, contains: str = "") -> dict:
    """``response`` is an OpenAI-style error with this status; its ``error`` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert contains.lower() in error["message"].lower(), error["message"]
    return error
