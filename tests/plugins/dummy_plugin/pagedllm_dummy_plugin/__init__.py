"""A third-party plugin, installed with pip, registering one of each kind of thing.

It is the worked example of pagedllm's plugin guide (``docs/plugins.md``): the code
between ``[docs:NAME]`` markers is what the guide shows, checked by the tests.
"""

# [docs:hooks]
from pagedllm import hookimpl


@hookimpl
def pagedllm_register_devices(registry):
    registry.add("dummydev", "pagedllm_dummy_plugin.device:DummyDevice")


@hookimpl
def pagedllm_register_attention_backends(registry):
    registry.add("dummy_attn", "pagedllm_dummy_plugin.attention:CountingBackend")


@hookimpl
def pagedllm_register_load_formats(registry):
    registry.add("dummyfmt", "pagedllm_dummy_plugin.loader:JsonWeightsLoader")


@hookimpl
def pagedllm_register_quantization_methods(registry):
    registry.add("dummyq", "pagedllm_dummy_plugin.quant:Int8RowConfig")


@hookimpl
def pagedllm_register_models(registry):
    registry.add("DummyNeoXForCausalLM", "pagedllm_dummy_plugin.model:DummyNeoXForCausalLM")
    registry.add(
        "DummyVisionNeoXForCausalLM", "pagedllm_dummy_plugin.vision:DummyVisionNeoXForCausalLM"
    )


@hookimpl
def pagedllm_register_multimodal_processors(registry):
    registry.add("DummyVisionNeoXForCausalLM", "pagedllm_dummy_plugin.vision:ColourTokensProcessor")


@hookimpl
def pagedllm_register_tool_parsers(registry):
    registry.add("dummy_tool", "pagedllm_dummy_plugin.tool_parser:CallLineToolParser")


@hookimpl
def pagedllm_register_reasoning_parsers(registry):
    registry.add("dummy_reasoning", "pagedllm_dummy_plugin.reasoning:ThinkTagReasoningParser")


@hookimpl
def pagedllm_register_guided_backends(registry):
    registry.add("dummy_choice", "pagedllm_dummy_plugin.guided:ChoiceBackend")


@hookimpl
def pagedllm_register_cli_subcommands(registry):
    registry.add("dummy-hello", "pagedllm_dummy_plugin.cli:HelloSubcommand")


@hookimpl
def pagedllm_register_executors(registry):
    registry.add("dummy_exec", "pagedllm_dummy_plugin.executor:CountingExecutor")


@hookimpl
def pagedllm_register_step_extensions(registry):
    registry.add("dummy_cap", "pagedllm_dummy_plugin.extension:CapExtension")


@hookimpl
def pagedllm_add_cli_args(parser, subcommand):
    if subcommand == "serve":
        parser.add_argument("--dummy-greeting", default=None, help="Added by the dummy plugin.")


# [/docs:hooks]
