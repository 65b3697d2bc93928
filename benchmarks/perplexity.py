"""Perplexity of a model on a fixed text, as llama.cpp's ``llama-perplexity`` measures it:
the text's tokens cut into chunks of ``--context`` tokens, each chunk run once, and the
second half of each chunk scored (every scored token sees at least half a context before
it). The scores are the engine's prompt logprobs, so the figure checks what a user's
requests compute, in the dtype the engine runs:

    python benchmarks/perplexity.py                       # the default model, auto and float32
    python benchmarks/perplexity.py --model DIR --dtype bfloat16 float32

The default text is ``benchmarks/data/opticks.txt``: the start of the first book of Isaac
Newton's *Opticks* (1730, public domain), about 23 KB. Run llama.cpp on the same file and
the same GGUF to compare: ``llama-perplexity -m FILE -f benchmarks/data/opticks.txt -c 512``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path
from typing import Any

TEXT = Path(__file__).parent / "data" / "opticks.txt"


def chunks(token_ids: list[int], context: int) -> list[list[int]]:
    """The whole chunks of ``context`` tokens (a shorter tail is left out, as llama.cpp's)."""
    if context < 2:
        raise ValueError("--context must be at least 2 tokens")
    count = len(token_ids) // context
    if count == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one chunk ({context})")
    return [token_ids[i * context : (i + 1) * context] for i in range(count)]


def negative_log_likelihoods(llm: Any, windows: list[list[int]]) -> list[float]:
    """Each scored token's negative log-likelihood: the second half of every window."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": window} for window in windows]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scores = []
    for window, output in zip(windows, outputs, strict=True):
        rows = output.prompt_logprobs
        for position in range(len(window) // 2, len(window)):
            scores.append(-rows[position][window[position]].logprob)
    return scores


def perplexity(llm: Any, text: str, context: int) -> dict[str, Any]:
    """The perplexity of ``text`` under ``llm``'s model, with the counts behind it."""
    token_ids = llm.get_tokenizer().encode(text)
    windows = chunks(token_ids, context)
    scores = negative_log_likelihoods(llm, windows)
    return {
        "perplexity": math.exp(sum(scores) / len(scores)),
        "text_tokens": len(token_ids),
        "chunks": len(windows),
        "scored_tokens": len(scores),
        "context": context,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: pagedllm's default)")
    parser.add_argument(
        "--dtype", nargs="+", default=["auto", "float32"], help="each dtype to measure"
    )
    parser.add_argument("--text", type=Path, default=TEXT, help="the text file")
    parser.add_argument("--context", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()

    from pagedllm import LLM
    from pagedllm.core.default_model import DEFAULT_MODEL

    text = args.text.read_text(encoding="utf-8")
    results = {}
    for dtype in args.dtype:
        llm = LLM(args.model or DEFAULT_MODEL, dtype=dtype, disable_log_stats=True)
        results[dtype] = perplexity(llm, text, args.context)
        llm.llm_engine.shutdown()
        del llm
        row = results[dtype]
        print(
            f"{dtype:>9}: perplexity {row['perplexity']:.4f} over {row['scored_tokens']} "
            f"tokens ({row['chunks']} chunks of {args.context})"
        )
    if "float32" in results:
        reference = results["float32"]["perplexity"]
        for dtype, row in results.items():
            if dtype != "float32":
                change = 100 * (row["perplexity"] / reference - 1)
                print(f"{dtype} against float32: {change:+.2f}%")
    if args.output_json is not None:
        cpu = platform.processor() or platform.machine()
        args.output_json.write_text(json.dumps({"cpu": cpu, "results": results}, indent=2))


if __name__ == "__main__":
    main()
