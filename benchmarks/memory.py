"""Resident memory of a server: idle after start-up and under ``bench serve`` load.

    python benchmarks/memory.py                            # pagedllm serve (default model)
    python benchmarks/memory.py -- MODEL --dtype float32   # pagedllm serve MODEL ...
    python benchmarks/memory.py --server 'llama-server -m FILE -t 2 -np 8 -c 8192 --port {port}'

Starts the server on a free port, times its first 200 on ``/health``, reads its RSS one
second later (``VmRSS``, split into anonymous and file-backed pages by
``/proc/PID/smaps_rollup``, plus the files mapped largest), then runs ``bench serve``
(random 128/128 prompts at ``--concurrency``) while sampling the RSS every 0.1 s, and
reports the peak and the RSS after the load. Also prints ``import torch``'s own RSS, the
floor any PyTorch engine starts from. Figures in MiB; compare runs from one machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import CLI, _health_ok, cpu_model, free_port, stop_group


def _kib(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key.strip()] = int(parts[0])
    return out


def memory(pid: int) -> dict[str, float]:
    """RSS, anonymous and file-backed resident MiB of ``pid`` (from /proc)."""
    status = _kib(Path(f"/proc/{pid}/status").read_text())
    rollup = _kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
    return {
        "rss": status["VmRSS"] / 1024,
        "anon": status.get("RssAnon", rollup.get("Anonymous", 0)) / 1024,
        "file": status.get("RssFile", 0) / 1024,
    }


def mapped_files(pid: int, top: int = 5) -> list[tuple[str, float]]:
    """The ``top`` files with the most resident MiB in ``pid``'s address space."""
    sizes: dict[str, int] = {}
    name = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 and head[5].startswith("/") else None
        elif name and line.startswith("Rss:"):
            sizes[name] = sizes.get(name, 0) + int(head[1])
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [(os.path.basename(path), kib / 1024) for path, kib in ranked]


def torch_floor() -> float:
    code = (
        "import re, torch; "
        "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])"
    )
    return int(subprocess.check_output([sys.executable, "-c", code], text=True)) / 1024


def measure(
    command: list[str], port: int, concurrency: int, prompts: int, tokenizer: str | None = None
) -> dict:
    log = tempfile.TemporaryFile()  # not a pipe: a full pipe would stall the server
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    try:
        while not _health_ok(port):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited:\n{log.read().decode()[-3000:]}")
            time.sleep(0.01)
        figures: dict = {"start_s": time.perf_counter() - start}
        time.sleep(1)
        figures["idle"] = memory(proc.pid)
        figures["idle_files"] = mapped_files(proc.pid)
        if prompts == 0:
            return figures
        peak = dict(figures["idle"])
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.1):
                now = memory(proc.pid)
                if now["rss"] > peak["rss"]:
                    peak.update(now)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with tempfile.TemporaryDirectory() as out:
            bench = [
                *CLI, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                "--dataset-name", "random", "--random-input-len", "128",
                "--random-output-len", "128", "--num-prompts", str(prompts),
                "--max-concurrency", str(concurrency), "--ignore-eos", "--disable-tqdm",
                "--save-result", "--result-dir", out, "--result-filename", "r.json",
                *(("--tokenizer", tokenizer) if tokenizer else ()),
            ]  # fmt: skip
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            result = json.loads((Path(out) / "r.json").read_text())
        done.set()
        sampler.join()
        figures["load_peak"] = peak
        figures["after_load"] = memory(proc.pid)
        figures["output_tok_s"] = result["output_throughput"]
        return figures
    finally:
        stop_group(proc, signal.SIGINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="a server command line with {port} (default: ours)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokenizer", help="bench serve's --tokenizer (e.g. the GGUF file)")
    parser.add_argument("--num-prompts", type=int, default=16, help="0: idle figures only")
    parser.add_argument("serve_args", nargs="*", help="after --: pagedllm serve's arguments")
    args = parser.parse_args()
    port = free_port()
    if args.server:
        command = shlex.split(args.server.format(port=port))
    else:
        command = [*CLI, "serve", *args.serve_args, "--host", "127.0.0.1", "--port", str(port)]
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}")
    print(f"import torch RSS: {torch_floor():.0f} MiB")
    figures = measure(command, port, args.concurrency, args.num_prompts, args.tokenizer)
    print(f"start to /health: {figures['start_s']:.2f} s")
    for key in ("idle", "load_peak", "after_load"):
        if key not in figures:
            continue
        m = figures[key]
        print(f"{key:>10}: RSS {m['rss']:.0f} MiB (anon {m['anon']:.0f}, file {m['file']:.0f})")
    print("idle, most resident files:", ", ".join(f"{n} {s:.0f}" for n, s in figures["idle_files"]))
    if "output_tok_s" in figures:
        print(f"output tok/s, concurrency {args.concurrency}: {figures['output_tok_s']:.0f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
