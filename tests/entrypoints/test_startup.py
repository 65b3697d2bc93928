"""Start-up: ``benchmarks/startup.py`` run as a smoke test (its timings are the
benchmark's business, not a test's), and what a CPU start must not import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env
from repo_paths import ROOT, load_script
from tiny_models import make_checkpoint

SCRIPT = ROOT / "benchmarks" / "startup.py"


def _python(code: str) -> str:
    """What ``python -c code`` prints, in a clean environment (it must exit 0)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def startup():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("startup") / "llama", "llama")


def test_the_benchmark_times_help_and_serve_to_health(startup, tiny_llama):
    assert startup.cpu_model()
    env = clean_env()
    assert startup.time_help(env=env) > 0
    serve_args = [str(tiny_llama), "--dtype", "float32", "--num-gpu-blocks-override", "64"]
    assert startup.time_serve(serve_args, timeout=300, env=env) > 0


def test_a_bad_serve_is_reported_with_its_output(startup):
    with pytest.raises(RuntimeError, match="did not answer 200 on /health"):
        startup.time_serve(["--no-such-flag"], timeout=120, env=clean_env())


def test_a_cpu_server_imports_neither_dynamo_nor_triton(tiny_llama):
    """torch._dynamo (1.3 s; imported by torch.compiler.disable) and triton (70 ms, 70 MB)
    serve compiled models and GPUs only: a CPU server's engine and HTTP app import
    neither until -O or a GPU asks for them."""
    code = (
        "import sys\n"
        "from pagedllm import LLM\n"
        "import pagedllm.entrypoints.openai.api_server\n"
        f"llm = LLM({str(tiny_llama)!r}, dtype='float32', disable_log_stats=True)\n"
        "llm.generate(['Hello'], use_tqdm=False)\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n"
    )
    stdout = _python(code)
    assert stdout.strip().splitlines()[-1] == "[]", stdout


def test_garbage_collection_is_off_while_serve_starts_only(startup, tiny_llama):
    """``pagedllm serve`` starts with the cyclic garbage collector off (start-up makes
    long-lived objects only) and turns it back on once the server answers, or when the
    start fails."""
    port = startup.free_port()
    code = (
        "import gc, http.client, os, signal, sys, threading, time\n"
        "from pagedllm.entrypoints.cli.main import main\n"
        "failed = main(['serve', sys.argv[1], '--lora-modules', 'a=b'])\n"
        "print('FAILED', failed, gc.isenabled(), flush=True)\n"
        "def probe():\n"
        "    while True:\n"
        "        try:\n"
        f"            connection = http.client.HTTPConnection('127.0.0.1', {port})\n"
        "            connection.request('GET', '/health')\n"
        "            if connection.getresponse().status == 200:\n"
        "                break\n"
        "        except OSError:\n"
        "            pass\n"
        "        time.sleep(0.05)\n"
        "    print('SERVING', gc.isenabled(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Thread(target=probe, daemon=True).start()\n"
        "gc.enable()\n"
        f"code = main(['serve', sys.argv[1], '--port', '{port}', '--dtype', 'float32',\n"
        "             '--num-gpu-blocks-override', '64', '--disable-log-stats'])\n"
        "print('STOPPED', code, gc.isenabled(), flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )
    marks = ("FAILED ", "SERVING ", "STOPPED ")
    lines = [line for line in result.stdout.splitlines() if line.startswith(marks)]
    expected = ["FAILED 2 True", "SERVING True", "STOPPED 0 True"]
    assert lines == expected, result.stdout + result.stderr[-3000:]


def test_help_lists_the_subcommands_without_building_their_options():
    """``pagedllm --help`` needs each subcommand's name and one-line help: not the engine
    arguments, YAML (``--config`` only) or asyncio, which took half of its 0.5 s."""
    code = (
        "import contextlib, io, sys\n"
        "from pagedllm.entrypoints.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "heavy = ('pagedllm.core.engine_args', 'pagedllm.core.argspec', 'yaml', 'asyncio')\n"
        "print(out.getvalue())\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    stdout = _python(code)
    lines = stdout.strip().splitlines()
    assert lines[-1] == "[]", stdout
    listing = "\n".join(lines[:-1])
    for name, text in (
        ("serve", "Start the OpenAI-compatible API server."),
        ("run-batch", "Run batch prompts and write results to file."),
        ("bench", "Benchmark latency"),
    ):
        assert any(line.split()[:1] == [name] and text in line for line in lines), listing
