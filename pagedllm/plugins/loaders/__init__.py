"""Built-in load formats (``--load-format``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_load_formats(registry):
    registry.add("auto", "pagedllm.plugins.loaders.default:AutoLoader")
    registry.add("safetensors", "pagedllm.plugins.loaders.default:SafetensorsLoader")
    registry.add("pt", "pagedllm.plugins.loaders.default:PtLoader")
    registry.add("npcache", "pagedllm.plugins.loaders.npcache:NpcacheLoader")
    registry.add("gguf", "pagedllm.plugins.loaders.gguf:GGUFLoader")
    registry.add("dummy", "pagedllm.plugins.loaders.dummy:DummyLoader")
    registry.add("bitsandbytes", "pagedllm.plugins.loaders.bitsandbytes:BitsAndBytesLoader")
    registry.add("mistral", "pagedllm.plugins.loaders.mistral:MistralLoader")
    registry.add("tensorizer", "pagedllm.plugins.loaders.tensorizer:TensorizerLoader")
    registry.add("sharded_state", "pagedllm.plugins.loaders.sharded_state:ShardedStateLoader")
    registry.add("runai_streamer", "pagedllm.plugins.loaders.runai_streamer:RunaiStreamerLoader")
