"""Built-in tool-call and reasoning parsers."""

from pagedllm.core.hookspecs import hookimpl

_REASONING = "pagedllm.plugins.parsers.reasoning.markers"


@hookimpl
def pagedllm_register_reasoning_parsers(registry):
    registry.add("deepseek_r1", f"{_REASONING}:DeepSeekR1ReasoningParser")
    registry.add("qwen3", f"{_REASONING}:Qwen3ReasoningParser")
    registry.add("granite", f"{_REASONING}:GraniteReasoningParser")
