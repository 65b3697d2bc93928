"""Built-in tool-call and reasoning parsers."""

from pagedllm.core.hookspecs import hookimpl

_REASONING = "pagedllm.plugins.parsers.reasoning.markers"
_TOOLS = "pagedllm.plugins.parsers.tool.formats"

TOOL_PARSERS = {
    "hermes": "HermesToolParser",
    "mistral": "MistralToolParser",
    "llama3_json": "Llama3JsonToolParser",
    "llama4_json": "Llama4JsonToolParser",
    "llama4_pythonic": "Llama4PythonicToolParser",
    "pythonic": "PythonicToolParser",
    "granite": "GraniteToolParser",
    "granite-20b-fc": "Granite20bFCToolParser",
    "internlm": "InternLMToolParser",
    "jamba": "JambaToolParser",
    "deepseek_v3": "DeepSeekV3ToolParser",
    "phi4_mini_json": "Phi4MiniJsonToolParser",
}


@hookimpl
def pagedllm_register_reasoning_parsers(registry):
    registry.add("deepseek_r1", f"{_REASONING}:DeepSeekR1ReasoningParser")
    registry.add("qwen3", f"{_REASONING}:Qwen3ReasoningParser")
    registry.add("granite", f"{_REASONING}:GraniteReasoningParser")


@hookimpl
def pagedllm_register_tool_parsers(registry):
    for name, cls in TOOL_PARSERS.items():
        registry.add(name, f"{_TOOLS}:{cls}")
