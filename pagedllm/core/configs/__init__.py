"""The engine's configuration objects, one per concern, each owning its fields' defaults
and checking its own values (:mod:`.base`). The engine arguments
(:class:`pagedllm.core.engine_args.EngineArgs`) take their defaults from these classes;
:func:`pagedllm.core.config.create_engine_config` builds them from the arguments and
freezes them once validated.

- :mod:`.model`: :class:`~.model.ModelConfig`, :class:`~.model.LoadConfig`;
- :mod:`.runtime`: decoding, parallelism, KV cache, LoRA, device, speculative decoding;
- :mod:`.scheduling`: scheduling, observability, compilation;
- :mod:`.multimodal`: multi-modal inputs (images per prompt, processor settings);
- :mod:`.kv_transfer`: moving prompts' KV cache between engines (--kv-transfer-config).
"""
