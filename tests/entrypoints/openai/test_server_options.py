"""Flags of ``pagedllm serve``: API keys, CORS, root path, TLS, middleware, served model
names, chat-template options, logging, docs, request ids and SIGTERM.

Two servers with compatible flags serve the whole module (they load at the same time):
``plain`` (HTTP, ``--api-key``, CORS lists, ``--root-path``, ``--middleware``, ...) and
``tls`` (HTTPS, ``PAGEDLLM_API_KEY``, ``--log-config-file``, ...).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import ssl
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import clean_env
from openai_server import (
    REQUEST_TIMEOUT,
    RemoteServer,
    assert_openai_error,
    start_servers,
    tiny_llama,
)

API_KEY = "sk-plain-key"
ENV_API_KEY = "sk-env-key"
ROOT = "/proxy"
GOOD_ORIGIN = "https://good.example"
USER = [{"role": "user", "content": "Hello"}]

# Loops over each message's content, so it needs OpenAI-style parts.
PARTS_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>>"
    "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<<reply>>{% endif %}"
)
# One line with an escaped newline, as an inline --chat-template is written.
INLINE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"

MIDDLEWARE = """
async def add_header(request, call_next):
    if request.url.path.endswith("/boom"):
        raise RuntimeError("boom from the test middleware")
    response = await call_next(request)
    response.headers["X-Function-Middleware"] = "yes"
    return response


class TagMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-class-middleware", b"yes")]
            await send(message)

        await self.app(scope, receive, tagged)
"""


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for 127.0.0.1 (also usable as the CA file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server_options")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, workdir: Path):
    model = tiny_llama(tmp_path_factory)

    (workdir / "mw_pkg").mkdir()
    (workdir / "mw_pkg" / "test_mw.py").write_text(MIDDLEWARE)
    template_file = workdir / "parts.jinja"
    template_file.write_text(PARTS_TEMPLATE)
    pythonpath = os.pathsep.join(
        p for p in (str(workdir / "mw_pkg"), os.environ.get("PYTHONPATH")) if p
    )
    plain = RemoteServer(
        model,
        "--served-model-name",
        "only-name",
        "--api-key",
        API_KEY,
        "--allowed-origins",
        json.dumps([GOOD_ORIGIN]),
        "--allowed-methods",
        json.dumps(["GET", "POST"]),
        "--allowed-headers",
        json.dumps(["Authorization", "Content-Type", "X-Custom"]),
        "--allow-credentials",
        "--root-path",
        ROOT,
        "--middleware",
        "test_mw.add_header",
        "--middleware",
        "test_mw.TagMiddleware",
        "--enable-request-id-headers",
        "--disable-fastapi-docs",
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        "--disable-frontend-multiprocessing",
        "--chat-template",
        str(template_file),
        "--chat-template-content-format",
        "openai",
        "--response-role",
        "reply",
        log_path=workdir / "plain.log",
        env=clean_env(PYTHONPATH=pythonpath),
        api_key=API_KEY,
    )

    key, cert = self_signed_certificate(workdir)
    log_config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"custom": {"format": "CUSTOMLOG %(name)s %(levelname)s %(message)s"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(workdir / "custom.log"),
                "formatter": "custom",
            }
        },
        "loggers": {
            "pagedllm": {"handlers": ["file"], "level": "INFO"},
            "uvicorn": {"handlers": ["file"], "level": "INFO", "propagate": False},
            "uvicorn.access": {"handlers": ["file"], "level": "INFO", "propagate": False},
        },
    }
    (workdir / "log_config.json").write_text(json.dumps(log_config))
    tls = RemoteServer(
        model,
        "--ssl-keyfile",
        str(key),
        "--ssl-certfile",
        str(cert),
        "--log-config-file",
        str(workdir / "log_config.json"),
        "--uvicorn-log-level",
        "warning",
        "--enable-log-requests",
        "--max-log-len",
        "12",
        "--return-tokens-as-token-ids",
        "--chat-template",
        INLINE_TEMPLATE,
        "--chat-template-content-format",
        "string",
        log_path=workdir / "tls.log",
        env=clean_env(PAGEDLLM_API_KEY=ENV_API_KEY),
        tls_ca=cert,
        api_key=ENV_API_KEY,
    )
    start_servers(plain, tls)
    yield plain, tls
    plain.stop()
    tls.stop()


@pytest.fixture(scope="module")
def plain(servers) -> RemoteServer:
    return servers[0]


@pytest.fixture(scope="module")
def tls(servers) -> RemoteServer:
    return servers[1]


def open_http(server: RemoteServer, **kwargs) -> httpx.Client:
    """A client that sends no API key."""
    return httpx.Client(
        base_url=server.url, verify=server.verify, timeout=REQUEST_TIMEOUT, **kwargs
    )


def wait_for_log(path: Path, needle: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# -------------------------------------------------------------------- API keys


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "Hi"}),
        ("POST", "/detokenize", {"tokens": [5]}),
        ("POST", "/invocations", {"prompt": "Hi", "max_tokens": 2}),
    ],
)
def test_api_key_required(plain: RemoteServer, method: str, path: str, body) -> None:
    with open_http(plain) as h:
        url = ROOT + path
        assert_openai_error(h.request(method, url, json=body), 401)
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert_openai_error(h.request(method, url, json=body, headers=wrong), 401)
        assert_openai_error(
            h.request(method, url, json=body, headers={"Authorization": API_KEY}), 401
        )
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert h.request(method, url, json=body, headers=good).status_code == 200


def test_api_key_with_openai_client(plain: RemoteServer) -> None:
    base = plain.url + ROOT + "/v1"
    with openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == ["only-name"]
        out = good.completions.create(model="only-name", prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens <= 2


def test_health_and_metrics_stay_open(plain: RemoteServer) -> None:
    with open_http(plain) as h:
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert h.get(path).status_code == 200, path
            assert h.get(ROOT + path).status_code == 200, path
        assert "pagedllm:num_requests_running" in h.get("/metrics").text


def test_api_key_from_environment(tls: RemoteServer) -> None:
    with open_http(tls) as h:
        assert_openai_error(h.get("/v1/models"), 401)
        assert_openai_error(h.get("/v1/models", headers={"Authorization": "Bearer x"}), 401)
        assert h.get("/health").status_code == 200
        ok = h.get("/v1/models", headers={"Authorization": f"Bearer {ENV_API_KEY}"})
        assert ok.status_code == 200


# ------------------------------------------------------------------------ CORS


def preflight(
    h: httpx.Client, origin: str, method: str = "POST", headers: str = ""
) -> httpx.Response:
    request_headers = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        request_headers["Access-Control-Request-Headers"] = headers
    return h.options(ROOT + "/v1/chat/completions", headers=request_headers)


def test_cors_allowed_origin_methods_headers(plain: RemoteServer) -> None:
    with open_http(plain) as h:
        ok = preflight(h, GOOD_ORIGIN, "POST", "authorization,content-type,x-custom")
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert {m.strip() for m in ok.headers["access-control-allow-methods"].split(",")} >= {
            "GET",
            "POST",
        }
        assert "x-custom" in ok.headers["access-control-allow-headers"].lower()

        for bad in (
            preflight(h, "https://evil.example"),
            preflight(h, GOOD_ORIGIN, "DELETE"),
            preflight(h, GOOD_ORIGIN, "POST", "x-other"),
        ):
            assert bad.status_code == 400
            assert bad.headers.get("access-control-allow-origin") != "https://evil.example"

        auth = {"Authorization": f"Bearer {API_KEY}"}
        simple = h.get(ROOT + "/v1/models", headers={**auth, "Origin": GOOD_ORIGIN})
        assert simple.status_code == 200
        assert simple.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert simple.headers["access-control-allow-credentials"] == "true"
        other = h.get(ROOT + "/v1/models", headers={**auth, "Origin": "https://evil.example"})
        assert other.status_code == 200
        assert "access-control-allow-origin" not in other.headers
        # a refused key still carries CORS headers, so a browser can read the 401
        refused = h.get(ROOT + "/v1/models", headers={"Origin": GOOD_ORIGIN})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_cors_defaults_allow_any_origin(tls: RemoteServer) -> None:
    with tls.http() as h:
        response = h.get("/v1/models", headers={"Origin": "https://anywhere.example"})
        assert response.headers["access-control-allow-origin"] == "*"
        options = preflight(h, "https://anywhere.example", "PUT", "x-anything")
        assert options.status_code == 200


# ------------------------------------------------------------------- root path


def test_root_path(plain: RemoteServer) -> None:
    with plain.http() as h:
        assert h.get(ROOT + "/v1/models").json()["data"][0]["id"] == "only-name"
        # behind a proxy that strips the prefix, the plain paths answer too
        assert h.get("/v1/models").status_code == 200
    with plain.client(base_url=plain.url + ROOT + "/v1") as c:
        out = c.chat.completions.create(model="only-name", messages=USER, max_tokens=2)
        assert out.model == "only-name"


# ------------------------------------------------------------------------- TLS


def test_tls(tls: RemoteServer) -> None:
    assert tls.url.startswith("https://")
    with tls.client() as c:
        out = c.completions.create(model=c.models.list().data[0].id, prompt="Hi", max_tokens=3)
        assert out.usage.completion_tokens <= 3
    # the certificate is self-signed: not trusted without the CA file
    with pytest.raises(httpx.ConnectError):
        httpx.get(tls.url + "/health", timeout=10)
    assert httpx.get(tls.url + "/health", verify=False, timeout=10).status_code == 200
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    assert httpx.get(tls.url + "/health", verify=context, timeout=10).status_code == 200
    # plain HTTP on the TLS port gets no answer
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls.url.replace("https://", "http://") + "/health", timeout=10)


# ------------------------------------------------------------ middleware, ids


def test_middleware_function_and_class(plain: RemoteServer) -> None:
    with open_http(plain) as h:
        for path in ("/health", ROOT + "/v1/models"):
            response = h.get(path, headers={"Authorization": f"Bearer {API_KEY}"})
            assert response.headers["x-function-middleware"] == "yes"
            assert response.headers["x-class-middleware"] == "yes"


def test_unexpected_error_is_a_json_500_and_the_server_goes_on(plain: RemoteServer) -> None:
    with plain.http() as h:
        error = assert_openai_error(h.get("/boom"), 500, "boom from the test middleware")
        assert error["type"] == "InternalServerError"
        assert h.get(ROOT + "/v1/models").status_code == 200


def test_request_id_headers(plain: RemoteServer, tls: RemoteServer) -> None:
    with plain.http() as h:
        generated = h.get("/health").headers["x-request-id"]
        assert len(generated) >= 16
        assert h.get("/health").headers["x-request-id"] != generated
        body = {"model": "only-name", "prompt": "Hi", "max_tokens": 2}
        response = h.post(
            ROOT + "/v1/completions", json=body, headers={"X-Request-Id": "my-request-17"}
        )
        assert response.headers["x-request-id"] == "my-request-17"
        assert response.json()["id"] == "cmpl-my-request-17"
    with tls.http() as h:  # (without --enable-request-id-headers: sent all the same)
        assert len(h.get("/health").headers["x-request-id"]) >= 16


# ------------------------------------------------------- names, chat, logprobs


def test_single_served_model_name(plain: RemoteServer) -> None:
    with plain.client(base_url=plain.url + ROOT + "/v1") as c:
        assert [m.id for m in c.models.list().data] == ["only-name"]
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        # no model given: the served one
        with plain.http() as h:
            out = h.post(ROOT + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert out.json()["model"] == "only-name"


def test_chat_template_file_openai_format_and_response_role(plain: RemoteServer) -> None:
    with plain.http() as h:
        rendered = h.post("/tokenize", json={"messages": USER}).json()
        text = h.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert text == "<<user>>Hello<<reply>>"
        parts = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
            }
        ]
        assert h.post("/tokenize", json={"messages": parts}).json() == rendered
    with plain.client(base_url=plain.url + ROOT + "/v1") as c:
        out = c.chat.completions.create(model="only-name", messages=USER, max_tokens=3)
        assert out.choices[0].message.role == "reply"
        assert out.usage.prompt_tokens == rendered["count"]
        chunks = list(
            c.chat.completions.create(model="only-name", messages=USER, max_tokens=3, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "reply"
        # without a generation prompt the answer continues the last message's role
        out = c.chat.completions.create(
            model="only-name",
            messages=USER,
            max_tokens=2,
            extra_body={"add_generation_prompt": False},
        )
        assert out.choices[0].message.role == "user"


def test_inline_chat_template_string_format(tls: RemoteServer) -> None:
    with tls.http() as h:
        parts = [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
        rendered = h.post("/tokenize", json={"messages": parts}).json()
        text = h.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert text == "system: Be brief.\nuser: a\nb\n"


def test_return_tokens_as_token_ids(tls: RemoteServer) -> None:
    with tls.client() as c:
        model = c.models.list().data[0].id
        chat = c.chat.completions.create(
            model=model, messages=USER, max_tokens=3, logprobs=True, top_logprobs=2
        )
        for item in chat.choices[0].logprobs.content:
            assert item.token.startswith("token_id:")
            int(item.token.removeprefix("token_id:"))
            assert all(t.token.startswith("token_id:") for t in item.top_logprobs)
        # (special tokens kept in the text, as /detokenize keeps them: the tiny model
        # samples <s> now and then)
        completion = c.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=3,
            logprobs=1,
            echo=True,
            extra_body={"skip_special_tokens": False},
        )
        tokens = completion.choices[0].logprobs.tokens
        assert all(t.startswith("token_id:") for t in tokens)
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        with tls.http() as h:
            text = h.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == completion.choices[0].text
        # a request can ask for the text back
        plain = c.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=3,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": False},
        )
        assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_defaults_without_flags(tls: RemoteServer) -> None:
    with tls.client() as c:
        model = c.models.list().data[0].id
        out = c.completions.create(model=model, prompt="Hi", max_tokens=2)
        # no --enable-prompt-tokens-details
        assert out.usage.prompt_tokens_details is None
        # no --scheduling-policy priority
        with pytest.raises(openai.BadRequestError, match="scheduling-policy priority"):
            c.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
        # docs are on by default
    with tls.http() as h:
        assert h.get("/openapi.json").status_code == 200


def test_disable_fastapi_docs(plain: RemoteServer) -> None:
    with plain.http() as h:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert h.get(path).status_code == 404, path
            assert h.get(ROOT + path).status_code == 404, path


# --------------------------------------------------------------------- logging


def test_logging_flags_of_the_plain_server(plain: RemoteServer) -> None:
    with plain.http() as h:
        h.post(ROOT + "/v1/completions", json={"prompt": "Do not log this prompt", "max_tokens": 2})
    time.sleep(0.3)
    log = plain.log_text()
    assert "Uvicorn running on" in log  # uvicorn logs at info
    assert "Do not log this prompt" not in log  # --disable-log-requests
    assert "received request" not in log
    assert "--disable-log-requests is deprecated" in log  # (not logging is the default)
    assert "POST /proxy/v1/completions" not in log and "HTTP/1.1" not in log  # no access log


def test_log_config_file_and_max_log_len(tls: RemoteServer, workdir: Path) -> None:
    with tls.http() as h:
        h.post("/v1/completions", json={"prompt": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "max_tokens": 2})
    custom = wait_for_log(workdir / "custom.log", "ABCDEFGHIJKL")
    assert "CUSTOMLOG pagedllm.server INFO received request cmpl-" in custom  # (enabled)
    assert "ABCDEFGHIJKL" in custom
    assert "ABCDEFGHIJKLM" not in custom  # --max-log-len 12
    # --uvicorn-log-level warning: neither uvicorn's start-up line nor access lines
    everything = custom + tls.log_text()
    assert "Uvicorn running on" not in everything
    assert "HTTP/1.1" not in everything


# ------------------------------------------------------------------- shutdown


def test_disable_frontend_multiprocessing_changes_nothing(plain: RemoteServer) -> None:
    """With one replica the engine runs on a thread of the API server's process anyway,
    which is what the flag asks for: the server, having served requests, has no child
    process."""
    assert plain.proc is not None
    with plain.http() as http:
        body = {"model": "only-name", "prompt": "hi", "max_tokens": 2}
        assert http.post(f"{ROOT}/v1/completions", json=body).status_code == 200
    tasks = Path(f"/proc/{plain.proc.pid}/task")
    children = [pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
    assert children == []


def test_sigterm_shuts_down_gracefully(plain: RemoteServer) -> None:
    """Runs last in this module: it stops the ``plain`` server."""
    assert plain.proc is not None and plain.proc.poll() is None
    started = time.monotonic()
    plain.proc.send_signal(signal.SIGTERM)
    assert plain.proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 15
    assert "Shutting down" in plain.log_text() or "Finished server process" in plain.log_text()
