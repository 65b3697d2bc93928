"""Built-in model architectures, registered under their Hugging Face names."""

from pagedllm.core.hookspecs import hookimpl

_LLAMA = "pagedllm.plugins.models.llama"
_QWEN_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
_IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


@hookimpl
def pagedllm_register_models(registry):
    registry.add("LlamaForCausalLM", f"{_LLAMA}:LlamaForCausalLM")
    registry.add("MistralForCausalLM", f"{_LLAMA}:MistralForCausalLM")
    registry.add("Qwen2ForCausalLM", f"{_LLAMA}:Qwen2ForCausalLM")
    registry.add("Qwen3ForCausalLM", f"{_LLAMA}:Qwen3ForCausalLM")
    for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        registry.add(name, f"pagedllm.plugins.models.moe:{name}")
    registry.add("Gemma2ForCausalLM", "pagedllm.plugins.models.gemma2:Gemma2ForCausalLM")
    registry.add("Gemma3ForCausalLM", "pagedllm.plugins.models.gemma3:Gemma3ForCausalLM")
    registry.add("PhiForCausalLM", "pagedllm.plugins.models.phi:PhiForCausalLM")
    registry.add("Phi3ForCausalLM", "pagedllm.plugins.models.phi3:Phi3ForCausalLM")
    registry.add("StableLmForCausalLM", "pagedllm.plugins.models.stablelm:StableLmForCausalLM")
    registry.add(
        "Starcoder2ForCausalLM", "pagedllm.plugins.models.starcoder2:Starcoder2ForCausalLM"
    )
    registry.add("OPTForCausalLM", "pagedllm.plugins.models.opt:OPTForCausalLM")
    registry.add("FalconForCausalLM", "pagedllm.plugins.models.falcon:FalconForCausalLM")
    registry.add("GPTNeoXForCausalLM", "pagedllm.plugins.models.gpt_neox:GPTNeoXForCausalLM")
    registry.add("GPT2LMHeadModel", "pagedllm.plugins.models.gpt2:GPT2LMHeadModel")
    # Vision-language models (their prompts' images: the multimodal processors below).
    registry.add(
        "LlavaForConditionalGeneration",
        "pagedllm.plugins.models.llava:LlavaForConditionalGeneration",
    )
    for name in _QWEN_VL:
        registry.add(name, f"pagedllm.plugins.models.qwen2_vl:{name}")
    for name in _IDEFICS3:
        registry.add(name, f"pagedllm.plugins.models.idefics3:{name}")
    registry.add(
        "Gemma3ForConditionalGeneration",
        "pagedllm.plugins.models.gemma3_mm:Gemma3ForConditionalGeneration",
    )
    # Sequence classification / reward heads on the native decoders.
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3"):
        name = f"{family}ForSequenceClassification"
        registry.add(name, f"pagedllm.plugins.models.classification:{name}")
    # Encoders for embeddings, classification and cross-encoder scores.
    for name in ("BertModel", "BertForSequenceClassification"):
        registry.add(name, f"pagedllm.plugins.models.bert:{name}")
    for kind in ("Model", "ForSequenceClassification"):
        for family in ("Roberta", "XLMRoberta"):
            registry.add(f"{family}{kind}", f"pagedllm.plugins.models.bert:Roberta{kind}")
    # Any transformers causal LM (--model-impl transformers, or auto without a native one).
    registry.add(
        "TransformersForCausalLM",
        "pagedllm.plugins.models.transformers_backend:TransformersForCausalLM",
    )


@hookimpl
def pagedllm_register_multimodal_processors(registry):
    registry.add(
        "LlavaForConditionalGeneration", "pagedllm.plugins.models.llava_processor:LlavaProcessor"
    )
    for name in _QWEN_VL:
        registry.add(name, "pagedllm.plugins.models.qwen2_vl_processor:Qwen2VLProcessor")
    for name in _IDEFICS3:
        registry.add(name, "pagedllm.plugins.models.idefics3_processor:Idefics3Processor")
    registry.add(
        "Gemma3ForConditionalGeneration",
        "pagedllm.plugins.models.gemma3_processor:Gemma3Processor",
    )
