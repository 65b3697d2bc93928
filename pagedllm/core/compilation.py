"""``-O``/``--compilation-config``, ``--cuda-graph-sizes``, ``--max-seq-len-to-capture``
and ``--enforce-eager``: how the model's forward pass is compiled and which decode steps
are replayed from graphs.

Levels (vLLM's numbering):

- 0: no compilation (the default);
- 1: TorchDynamo captures the model's Python into FX graphs that run as they are (the
  ``eager`` backend: no code generation), which checks that a model traces;
- 2 and 3: TorchInductor compiles those graphs (fused element-wise kernels: norms,
  activations, residual adds), with dynamic shapes so that one compilation serves every
  batch size. Attention always runs outside the compiled pieces (its backend's own
  kernels), so 3, vLLM's piecewise level and the recommended one, is the same as 2 here.

Graphs of decode steps (CUDA graphs on the cuda device) are captured for the batch sizes
of ``--cuda-graph-sizes`` (or the config's ``cudagraph_capture_sizes``) unless
``--enforce-eager`` (or ``"use_cudagraph": false``); they replay a compiled model as well.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedllm.core.configs.scheduling import CompilationConfig
from pagedllm.core.errors import ConfigError

__all__ = ["COMPILATION_KEYS", "CompilationConfig", "compilation_config", "compile_model"]

logger = logging.getLogger(__name__)

# The keys of a JSON --compilation-config pagedllm acts on (matched without case: the
# seeds write "CUDAgraph_capture_sizes").
COMPILATION_KEYS = ("level", "cudagraph_capture_sizes", "use_cudagraph")


def graph_sizes(values: list[int]) -> list[int]:
    """``--cuda-graph-sizes``: one value N means 1, 2, 4 and the multiples of 8 up to N;
    several values are the sizes themselves."""
    if len(values) == 1:
        (top,) = values
        return sorted({n for n in (1, 2, 4, *range(8, top + 1, 8)) if n <= top})
    return sorted(set(values))


def compilation_config(args: Any, max_num_seqs: int) -> CompilationConfig:
    """The :class:`CompilationConfig` of validated engine args."""
    raw = args.compilation_config
    settings: dict[str, Any] = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key.lower() not in COMPILATION_KEYS:
                raise ConfigError(
                    f"--compilation-config: {key!r} is not supported by pagedllm (it reads "
                    f"{', '.join(COMPILATION_KEYS)})"
                )
            settings[key.lower()] = value
    else:
        settings["level"] = raw or 0
    level = settings.get("level", 0)
    if level not in (0, 1, 2, 3):
        raise ConfigError(f"--compilation-config: level {level!r} is not one of 0, 1, 2, 3")
    sizes = settings.get("cudagraph_capture_sizes")
    if sizes is None:
        sizes = graph_sizes(list(args.cuda_graph_sizes))
    elif not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
        raise ConfigError("--compilation-config: cudagraph_capture_sizes must be a list of ints")
    if any(n < 1 for n in sizes) or args.max_seq_len_to_capture < 1:
        raise ConfigError(
            "CUDA graph sizes (--cuda-graph-sizes, cudagraph_capture_sizes) and "
            "--max-seq-len-to-capture must be positive"
        )
    sizes = sorted(set(sizes))
    # Sizes past the most decodes a step can hold are never used: keep up to the first
    # that covers max_num_seqs.
    covering = [n for n in sizes if n >= max_num_seqs]
    sizes = [n for n in sizes if n < max_num_seqs] + covering[:1]
    use_graphs = settings.get("use_cudagraph", True) and not args.enforce_eager
    return CompilationConfig(
        level=int(level),
        capture_sizes=sizes if use_graphs else [],
        max_seq_len_to_capture=args.max_seq_len_to_capture,
    )


def compile_model(model: torch.nn.Module, level: int) -> None:
    """Compile ``model``'s forward pass for ``level`` (see the module docstring)."""
    if level == 0:
        return
    from pagedllm.core.attention.layer import prepare_compile

    prepare_compile()
    backend = "eager" if level == 1 else "inductor"
    logger.info(
        "compiling the model's forward pass with torch.compile (%s, level %d)", backend, level
    )
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
