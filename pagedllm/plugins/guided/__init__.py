"""Built-in guided-decoding backends (``--guided-decoding-backend``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_guided_backends(registry):
    registry.add("outlines", "pagedllm.plugins.guided.outlines:OutlinesBackend")
    registry.add("xgrammar", "pagedllm.plugins.guided.xgrammar:XGrammarBackend")
