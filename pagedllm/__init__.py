"""pagedllm: LLM inference and serving with a paged KV cache, where every variable part
(devices, load formats, quantization, model architectures, parsers, guided decoding) is
a plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.hookspecs import hookimpl

__version__ = "0.1.0"

# Heavy names are imported on first use so that ``pagedllm --help`` stays fast.
_LAZY = {
    "EngineArgs": "pagedllm.core.engine_args",
    "make_plugin_manager": "pagedllm.core.plugins",
}

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import make_plugin_manager


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["EngineArgs", "__version__", "hookimpl", "make_plugin_manager"]
