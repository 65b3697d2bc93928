"""The cuda device's validation on a GPU machine (issue 13): a SmolLM2-135M-shaped
checkpoint (SmolLM2's Llama config, random weights: the real ones do not travel to the
GPU machine), greedy parity with transformers on the GPU in float32 and bfloat16, and
``pagedllm bench latency`` / ``throughput`` with the batch-1 decode time against the HBM
roofline.

    TRITON_INTERPRET=0 python benchmarks/gpu_check.py --out DIR

Writes DIR/gpu_check.json and the benches' output to DIR/bench.log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# SmolLM2-135M(-Instruct)'s config.json.
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def make_model(directory: Path) -> Path:
    from tokenizer_fixtures import make_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = transformers.LlamaConfig(
        **SMOLLM2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # wider logits than the init's near-flat ones
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(2.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def reference_tokens(model, prompt: list[int], new: int) -> tuple[list[int], float]:
    """transformers' greedy tokens and the smallest top-1/top-2 logit gap among them."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    gaps = [float(step[0].float().topk(2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), min(gaps)


def parity(directory: Path, dtype: str, new: int = 32) -> dict:
    from pagedllm import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 33, 120, 300)]
    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype)
    model = model.to("cuda").eval()
    expected = [reference_tokens(model, p, new) for p in prompts]
    del model
    torch.cuda.empty_cache()
    llm = LLM(str(directory), device="cuda", dtype=dtype, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for (tokens, gap), output in zip(expected, outputs, strict=True):
        ours = list(output.outputs[0].token_ids)
        pairs = enumerate(zip(ours, tokens, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(tokens))
        rows.append({"matching_prefix": same, "of": len(tokens), "min_logit_gap": gap})
    graphs = llm.llm_engine.runner.graphs
    result = {
        "dtype": dtype,
        "identical": all(r["matching_prefix"] == r["of"] for r in rows),
        "prompts": rows,
        "graph_replays": graphs.replays if graphs is not None else None,
    }
    if graphs is not None:
        # The GPU's time for a decode step alone: a captured graph replayed back to back
        # (its inputs those of the last step: the same values are written again).
        for size in (1, graphs.max_batch):
            graph = graphs.graphs[size][0]
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            result[f"graph_replay_ms_batch{size}"] = begin.elapsed_time(end) / 50
    del llm
    torch.cuda.empty_cache()
    return result


def bench(out: Path, name: str, *args: str) -> dict:
    target = Path("/tmp") / f"{name}.json"
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", *args]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "--output-json", str(target)], capture_output=True, text=True, timeout=300
    )
    with (out / "bench.log").open("a") as log:
        log.write(f"==== {name}: {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    result = json.loads(target.read_text()) if target.exists() else {}
    result.pop("latencies", None)
    return {"returncode": done.returncode, "seconds": time.perf_counter() - start, **result}


def serve(directory: Path, out: Path, device: str = "cuda") -> dict:
    """``pagedllm serve`` on the GPU, asked through the official openai client."""
    import openai

    log = (out / "serve.log").open("w")
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", str(directory)]
    server = subprocess.Popen(
        [*command, "--device", device, "--port", "8011", "--served-model-name", "smol"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:8011/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    return {"error": "the server did not start", "returncode": server.poll()}
                time.sleep(1)
        completion = client.completions.create(
            model="smol", prompt=[5, 6, 7, 8], max_tokens=16, temperature=0
        )
        stream = client.completions.create(
            model="smol", prompt=[9, 10, 11], max_tokens=8, temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        return {
            "completion_tokens": completion.usage.completion_tokens,
            "finish_reason": completion.choices[0].finish_reason,
            "streamed_chars": len(streamed),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-135m-shaped"))
    steps = ["parity", "bench", "bench_o3", "serve"]
    parser.add_argument("--skip", nargs="*", default=[], choices=steps)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    import triton

    report["triton"] = triton.__version__
    start = time.perf_counter()
    directory = make_model(args.model_dir)
    report["make_model_s"] = time.perf_counter() - start

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    if "parity" not in args.skip:
        for dtype in ("float32", "bfloat16"):
            try:
                report[f"parity_{dtype}"] = parity(directory, dtype)
            except Exception as exc:  # keep going: the benches still run
                report[f"parity_{dtype}"] = {"error": repr(exc)}
            save()
    model = ["--model", str(directory), "--device", "cuda", "--dtype", "bfloat16"]
    latency = ["latency", *model, "--input-len", "32", "--output-len", "128"]
    latency += ["--batch-size", "1", "--num-iters", "5", "--num-iters-warmup", "2"]
    if "bench" not in args.skip:
        report["latency_graphs"] = bench(args.out, "latency_graphs", *latency)
        save()
        report["latency_eager"] = bench(args.out, "latency_eager", *latency, "--enforce-eager")
        save()
        throughput = ["throughput", *model, "--num-prompts", "1000"]
        throughput += ["--input-len", "128", "--output-len", "128"]
        report["throughput"] = bench(args.out, "throughput", *throughput)
        save()
    if "bench_o3" not in args.skip:
        report["latency_graphs_O3"] = bench(args.out, "latency_graphs_O3", *latency, "-O3")
        save()
    if "serve" not in args.skip:
        try:
            report["serve"] = serve(directory, args.out)
        except Exception as exc:
            report["serve"] = {"error": repr(exc)}
        save()
    # Batch-1 decode against the HBM roofline: every weight read once per token.
    report["weight_bytes_bf16"] = 2 * sum(_param_counts(directory).values())
    for kind in ("latency_graphs", "latency_eager", "latency_graphs_O3"):
        avg = report.get(kind, {}).get("avg_latency")
        if avg:
            report[kind]["ms_per_token"] = 1000 * avg / 128
    save()
    print(json.dumps(report, indent=2))


def _param_counts(directory: Path) -> dict[str, int]:
    from safetensors import safe_open

    counts = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                counts[name] = f.get_slice(name).get_shape()
    return {k: int(torch.Size(v).numel()) for k, v in counts.items()}


if __name__ == "__main__":
    main()
