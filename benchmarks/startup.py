"""Start-up times: ``pagedllm --help`` and ``pagedllm serve`` to its first 200 on ``/health``.

    python benchmarks/startup.py --runs 5              # the default model
    python benchmarks/startup.py --runs 5 -- MODEL_DIR --dtype float32

Each serve run starts a fresh process on a free port and polls ``/health`` every 10 ms; the
first run also fills the on-disk caches (compiled kernels, tokenizer), so it is reported
apart as "cold" and the median is taken over the warm runs that follow. Prints the CPU
model: compare numbers from one machine only.

Python's bytecode cache counts among those caches (pip compiles an installed package's
modules; an editable install writes them at its first import). Where
``PYTHONDONTWRITEBYTECODE`` is set, every start compiles pagedllm's modules again (about
0.15 s): ``--bytecode-cache DIR`` lets the runs keep their bytecode in DIR
(``PYTHONPYCACHEPREFIX``), as an installed package would.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

CLI = (sys.executable, "-m", "pagedllm.entrypoints.cli.main")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(process: subprocess.Popen, first: signal.Signals) -> None:
    """Stop a server started in its own session and every process it started: ``first``,
    then SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, first)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def time_help(cli: Sequence[str] = CLI, env: dict[str, str] | None = None) -> float:
    """Seconds for ``pagedllm --help`` to print its help and exit (which it must, 0)."""
    start = time.perf_counter()
    subprocess.run([*cli, "--help"], check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def _health_ok(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def time_serve(
    serve_args: Sequence[str] = (),
    cli: Sequence[str] = CLI,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> float:
    """Seconds from starting ``pagedllm serve SERVE_ARGS`` to its first 200 on ``/health``;
    the server is stopped (SIGINT, as Ctrl-C) before returning. Raises RuntimeError with
    the server's output when it exits or does not answer within ``timeout`` seconds."""
    port = free_port()
    command = [*cli, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        while True:
            if _health_ok(port):
                return time.perf_counter() - start
            if process.poll() is not None or time.perf_counter() - start > timeout:
                break
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    raise RuntimeError(
        f"{' '.join(command)} did not answer 200 on /health within {timeout} s "
        f"(exit code {process.returncode}):\n{output[-4000:]}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="warm runs of each measurement")
    parser.add_argument(
        "serve_args", nargs="*", help="arguments after 'serve' (none: the default model)"
    )
    parser.add_argument(
        "--bytecode-cache",
        metavar="DIR",
        help="keep the runs' Python bytecode in DIR, even where PYTHONDONTWRITEBYTECODE is set",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    env = dict(os.environ)
    if args.bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = args.bytecode_cache
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)")
    if env.get("PYTHONDONTWRITEBYTECODE"):
        print("PYTHONDONTWRITEBYTECODE is set: every start compiles pagedllm's modules")
    time_help(env=env)  # page the interpreter and pagedllm's modules in
    helps = [time_help(env=env) for _ in range(args.runs)]
    print(f"pagedllm --help: median {statistics.median(helps):.3f} s over {args.runs} runs")
    cold = time_serve(args.serve_args, env=env)
    serves = [time_serve(args.serve_args, env=env) for _ in range(args.runs)]
    print(f"serve to /health 200: first (cold caches) {cold:.3f} s")
    print(
        f"serve to /health 200: median {statistics.median(serves):.3f} s over {args.runs} "
        f"warm runs (min {min(serves):.3f}, max {max(serves):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
