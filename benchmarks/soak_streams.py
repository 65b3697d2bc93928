"""Soak test: rounds of N concurrent streaming requests; the server's RSS after each.

Answers "does the server's memory grow without bound under streaming load?". It either
talks to a running server (``--url``, with ``--pid`` or found by its port) or starts one
itself (``--model PATH``, or ``--model default`` for the embedded SmolLM2 model).

Examples::

    # the tiny test checkpoint, 20 rounds of 256 streams of 32 tokens
    python benchmarks/soak_streams.py --model /tmp/tiny_llama --rounds 20 --concurrency 256 \
        --max-tokens 32 -- --dtype float32 --num-gpu-blocks-override 128

    # the default model (SmolLM2), chat completions, 64 streams
    python benchmarks/soak_streams.py --model default --rounds 15 --concurrency 64 \
        --max-tokens 32 --chat

    # a server that is already running
    python benchmarks/soak_streams.py --url http://127.0.0.1:8000 --pid 12345

Arguments after ``--`` go to ``pagedllm serve``. ``--debug`` puts a small plugin on the
server's PYTHONPATH that adds ``GET /debug/soak`` (engine dict sizes, glibc heap figures,
the growth of Python allocations when tracing with ``--tracemalloc``); after the last
round it calls ``malloc_trim(0)`` in the server and prints the RSS before and after: RSS
that falls back is free heap kept by the allocator, not live objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import psutil

DEBUG_PLUGIN = '''
"""pagedllm plugin for benchmarks/soak_streams.py: GET /debug/soak."""

import collections
import ctypes
import gc
import os
import tracemalloc

from pagedllm import hookimpl

_PAGE = os.sysconf("SC_PAGE_SIZE")
_state = {"snapshot": None, "types": None}
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _libc = None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def _mallinfo():
    if _libc is None or not hasattr(_libc, "mallinfo2"):
        return None
    _libc.mallinfo2.restype = _Mallinfo2
    info = _libc.mallinfo2()
    mb = lambda v: round(v / 2**20, 2)
    return {"arena_mb": mb(info.arena), "mmap_mb": mb(info.hblkhd),
            "in_use_mb": mb(info.uordblks), "free_mb": mb(info.fordblks)}


def _resident_mb(ptr, nbytes):
    """Resident MiB of the address range (mincore), or None."""
    if _libc is None or nbytes <= 0:
        return None
    start = ptr - ptr % _PAGE
    length = ptr + nbytes - start
    pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return None
    return sum(v & 1 for v in vec) * _PAGE / 2**20


def _kv_cache(engine):
    """(allocated MiB, resident MiB) of the KV-cache tensors."""
    caches = getattr(engine.engine.runner, "kv_caches", None) or []
    allocated = resident = 0.0
    for tensor in caches:
        if tensor.device.type != "cpu":
            return None
        nbytes = tensor.numel() * tensor.element_size()
        allocated += nbytes / 2**20
        value = _resident_mb(tensor.data_ptr(), nbytes)
        if value is None:
            return None
        resident += value
    return round(allocated, 2), round(resident, 2)


def _len(obj):
    try:
        return len(obj)
    except Exception:
        return None


def _sizes(engine):
    eng = engine.engine
    sched = eng.scheduler
    kv = eng.kv_manager
    pool = kv.block_pool
    sizes = {
        "async._streams": _len(engine._streams),
        "async._commands": engine._commands.qsize(),
        "engine.parents": _len(eng.parents),
        "engine.sequences": _len(eng.sequences),
        "engine._compiling": _len(getattr(eng, "_compiling", ())),
        "engine.failed": _len(eng.failed),
        "scheduler.requests": _len(sched.requests),
        "scheduler.running": _len(sched.running),
        "scheduler.waiting": _len(sched.waiting),
        "kv._requests": _len(getattr(kv, "_requests", ())),
        "kv.free_blocks": pool.get_num_free_blocks(),
        "kv.num_blocks": pool.num_blocks,
        "kv.prefix_cache_map": _len(pool.cached_block_hash_to_block),
        "guided._cache": _len(getattr(eng.extensions["guided"].manager, "_cache", ())),
        "threads": len(__import__("threading").enumerate()),
    }
    for listener in engine.step_listeners:
        metrics = getattr(listener, "__self__", None)
        registry = getattr(metrics, "registry", None)
        if registry is not None:
            sizes["prometheus_samples"] = sum(
                len(m.samples) for m in registry.collect())
    return sizes


@hookimpl
def pagedllm_add_api_routes(app, engine):
    @app.get("/debug/soak")
    async def debug_soak(trim: int = 0, top: int = 12, types: int = 1):
        out = {"gc_collected": gc.collect(), "rss_mb": round(_rss_mb(), 2)}
        out["sizes"] = _sizes(engine)
        kv = _kv_cache(engine)
        if kv is not None:
            out["kv_allocated_mb"], out["kv_resident_mb"] = kv
            out["rss_minus_kv_mb"] = round(out["rss_mb"] - kv[1], 2)
        out["mallinfo"] = _mallinfo()
        if types:
            counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
            previous = _state["types"]
            if previous is not None:
                grown = {k: v - previous.get(k, 0) for k, v in counts.items()}
                out["gc_object_growth"] = dict(sorted(
                    ((k, d) for k, d in grown.items() if d), key=lambda kv: -abs(kv[1]))[:top])
            out["gc_objects"] = sum(counts.values())
            _state["types"] = counts
        if tracemalloc.is_tracing():
            current, peak = tracemalloc.get_traced_memory()
            out["tracemalloc_current_mb"] = round(current / 2**20, 2)
            out["tracemalloc_peak_mb"] = round(peak / 2**20, 2)
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            if _state["snapshot"] is not None:
                stats = snapshot.compare_to(_state["snapshot"], "lineno")
                out["tracemalloc_growth"] = [
                    f"{s.size_diff / 1024:+.1f} KiB {s.count_diff:+d} blocks  "
                    f"{s.traceback[0].filename}:{s.traceback[0].lineno}"
                    for s in stats[:top]]
            _state["snapshot"] = snapshot
        if trim and _libc is not None:
            before = _rss_mb()
            _libc.malloc_trim(0)
            out["trim"] = {"rss_before_mb": round(before, 2),
                           "rss_after_mb": round(_rss_mb(), 2),
                           "mallinfo_after": _mallinfo()}
        return out
'''


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (lscpu failed)"
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_on_port(port: int) -> int | None:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


def write_debug_plugin(site: Path) -> None:
    info = site / "pagedllm_soak_debug-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pagedllm-soak-debug\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text("[pagedllm]\nsoak_debug = pagedllm_soak_debug\n")
    (site / "pagedllm_soak_debug.py").write_text(textwrap.dedent(DEBUG_PLUGIN))


class Server:
    """``pagedllm serve`` in a subprocess, its output in a log file."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.port = args.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve"]
        if args.model != "default":
            command.append(args.model)
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--disable-log-stats", "--disable-log-requests"]
        command += ["--disable-uvicorn-access-log", *args.server_args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
        for item in args.server_env:
            key, _, value = item.partition("=")
            env[key] = value
        if args.debug:
            site = workdir / "site"
            write_debug_plugin(site)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        if args.tracemalloc:
            env["PYTHONTRACEMALLOC"] = str(args.tracemalloc)
        self.log_path = workdir / "server.log"
        self.log = self.log_path.open("wb")
        print("server:", " ".join(command), flush=True)
        extra = [f"{k}={env[k]}" for k in ("MALLOC_ARENA_MAX", "PYTHONTRACEMALLOC") if k in env]
        if extra:
            print("server env:", " ".join(extra), flush=True)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the server did not start in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def one_stream(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, tag: str
) -> tuple[int, str | None]:
    """One streaming request; (content chunks received, error or None)."""
    text = f"Soak request {tag}: write a short story about a lighthouse keeper."
    body: dict = {
        "model": model,
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    if args.chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return 0, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                if '"error"' in data and json.loads(data).get("error"):
                    return chunks, f"stream error: {data[:200]}"
                chunks += 1
    except httpx.HTTPError as exc:
        return chunks, f"{type(exc).__name__}: {exc}"
    return chunks, None


def rss_mb(proc: psutil.Process) -> float:
    """RSS of the server process and its children (a server with workers)."""
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def slope(values: list[float]) -> float:
    """Least-squares growth per round."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def print_debug(info: dict, verbose: bool) -> None:
    if "kv_resident_mb" in info:
        print(
            f"      KV cache: {info['kv_resident_mb']:.1f} of {info['kv_allocated_mb']:.1f} MB "
            f"resident; server RSS {info['rss_mb']:.1f} MB, RSS minus resident KV cache "
            f"{info['rss_minus_kv_mb']:.1f} MB"
        )
    sizes = info.get("sizes", {})
    print("      sizes:", " ".join(f"{k}={v}" for k, v in sizes.items()))
    if info.get("mallinfo"):
        print("      glibc heap:", info["mallinfo"], f"gc objects={info.get('gc_objects')}")
    if "tracemalloc_current_mb" in info:
        print(
            f"      tracemalloc: current {info['tracemalloc_current_mb']} MB, "
            f"peak {info['tracemalloc_peak_mb']} MB"
        )
    if verbose:
        if info.get("gc_object_growth"):
            print("      gc object growth:", info["gc_object_growth"])
        for line in info.get("tracemalloc_growth", []):
            print("        ", line)


async def soak(args: argparse.Namespace, url: str, pid: int) -> int:
    proc = psutil.Process(pid)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]

        async def debug() -> dict | None:
            if not args.debug:
                return None
            return (await client.get("/debug/soak", timeout=600)).json()

        await asyncio.sleep(args.pause)
        base = rss_mb(proc)
        print(f"model {model}; RSS before load: {base:.1f} MB", flush=True)
        info = await debug()
        if info:
            print_debug(info, False)
        rss: list[float] = []
        kv_resident: list[float] = []
        rss_minus_kv: list[float] = []
        failures = 0
        for round_index in range(args.rounds):
            start = time.perf_counter()
            results = await asyncio.gather(
                *(
                    one_stream(client, args, model, f"{round_index}-{i}")
                    for i in range(args.concurrency)
                )
            )
            elapsed = time.perf_counter() - start
            errors = [e for _, e in results if e]
            failures += len(errors)
            chunks = sum(c for c, _ in results)
            await asyncio.sleep(args.pause)
            info = await debug()
            value = rss_mb(proc)
            rss.append(value)
            delta = value - (rss[-2] if len(rss) > 1 else base)
            print(
                f"round {round_index + 1:3d}: RSS {value:8.1f} MB ({delta:+6.1f})  "
                f"{elapsed:6.1f} s  {chunks} chunks  {len(errors)} errors",
                flush=True,
            )
            if errors:
                print("      first error:", errors[0])
            if info:
                print_debug(info, args.verbose)
                if "kv_resident_mb" in info:
                    kv_resident.append(info["kv_resident_mb"])
                    rss_minus_kv.append(info["rss_minus_kv_mb"])
        half = rss[len(rss) // 2 :]
        print()
        print(f"CPU: {cpu_model()}; {os.cpu_count()} cores")
        print("RSS per round (MB):", " ".join(f"{v:.1f}" for v in rss))
        print(
            f"RSS: {base:.1f} MB before load -> {rss[0]:.1f} after round 1 -> "
            f"{rss[-1]:.1f} after round {len(rss)}"
        )
        if len(half) >= 2:
            print(
                f"growth over the last {len(half)} rounds: {slope(half):+.2f} MB/round "
                f"(least squares), {(half[-1] - half[0]) / (len(half) - 1):+.2f} MB/round "
                f"(end points); over all rounds {slope(rss):+.2f} MB/round"
            )
        if rss_minus_kv:
            print("KV cache resident per round (MB):", " ".join(f"{v:.1f}" for v in kv_resident))
            print(
                "RSS minus resident KV cache per round (MB):",
                " ".join(f"{v:.1f}" for v in rss_minus_kv),
            )
            tail = rss_minus_kv[len(rss_minus_kv) // 2 :]
            if len(tail) >= 2:
                print(
                    f"RSS minus KV cache, growth over the last {len(tail)} rounds: "
                    f"{slope(tail):+.2f} MB/round (least squares)"
                )
        if args.debug:
            info = (
                await client.get("/debug/soak", params={"trim": 1, "types": 0}, timeout=600)
            ).json()
            trim = info.get("trim")
            if trim:
                print(
                    f"malloc_trim(0): RSS {trim['rss_before_mb']:.1f} -> "
                    f"{trim['rss_after_mb']:.1f} MB; glibc heap after: {trim['mallinfo_after']}"
                )
            print_debug(info, False)
        if failures:
            print(f"{failures} requests failed")
        return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- are passed to `pagedllm serve` (with --model).",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start a server for this model ('default': SmolLM2)")
    parser.add_argument("--pid", type=int, help="the server's pid with --url (else by port)")
    parser.add_argument("--port", type=int, help="port for the started server (default: free)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chat", action="store_true", help="chat completions, not completions")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: always max-tokens tokens)",
    )
    parser.add_argument("--pause", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the started server (e.g. MALLOC_ARENA_MAX=2)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="add GET /debug/soak to the started server; malloc_trim at the end",
    )
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="start the server with PYTHONTRACEMALLOC=FRAMES (with --debug)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with --debug: print object-count and tracemalloc growth per round",
    )
    parser.add_argument("server_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.url and (args.debug or args.tracemalloc or args.server_env or args.server_args):
        parser.error("--debug, --tracemalloc, --server-env and serve arguments need --model")
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores", flush=True)
    if args.url:
        pid = args.pid or pid_on_port(httpx.URL(args.url).port or 80)
        if pid is None:
            parser.error("cannot find the server's pid by its port: pass --pid")
        return asyncio.run(soak(args, args.url.rstrip("/"), pid))
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-soak-"))
    server = Server(args, workdir)
    try:
        server.wait_ready(args.start_timeout)
        return asyncio.run(soak(args, server.url, server.pid))
    finally:
        server.stop()
        print(f"server log: {server.log_path}")
        if not args.debug:
            shutil.rmtree(workdir / "site", ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
