"""``--quantization bitsandbytes``: bitsandbytes' 4-bit (NF4, FP4, double-quantized or
not) and 8-bit (LLM.int8) weights, read from checkpoints as transformers saves them, or
4-bit NF4 quantized at load from a float checkpoint (vLLM's in-flight quantization, with
bitsandbytes' own ``quantize_4bit``: the same bytes transformers would make).

A 4-bit checkpoint stores each quantized layer's weight as flat blocks with a
``quant_state`` beside it (``weight.absmax``, ``weight.quant_map``, the nested statistics
of double quantization, and a JSON description); ``--load-format bitsandbytes``
(:mod:`pagedllm.plugins.loaders.bitsandbytes`) turns those into three plain tensors per
layer, with :func:`~pagedllm.kernels.quant_layouts.read_4bit`: ``weight`` (uint8
``[out, in / 2]``), ``weight_absmax`` (float32 ``[out, in / 64]``, double quantization
decoded as bitsandbytes decodes it before each product) and ``weight_code`` (the 16-entry
codebook). An 8-bit layer is ``weight`` (int8) and ``SCB`` (each row's largest
magnitude).

Products are weight-only (:mod:`pagedllm.kernels.bnb`): the weights decode exactly to
bitsandbytes' values and activations stay in the model's dtype. bitsandbytes' LLM.int8
also quantizes activations to 8 bits with an outlier threshold (``llm_int8_threshold``),
which depends on the whole batch; pagedllm does not, so 8-bit models agree with
transformers' bitsandbytes model within a tolerance, and exactly with the dequantized
weights. Embeddings and ``lm_head`` stay in floats, as transformers leaves them.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import LinearMethod, QuantizationConfig
from pagedllm.core.model_files import resolve_model_path
from pagedllm.kernels.bnb import int8_row_scale, linear_4bit, linear_int8
from pagedllm.kernels.quant_layouts import ABSMAX_GROUP, read_4bit
from pagedllm.plugins.quantization.common import checkpoint_param, left_in_floats

logger = logging.getLogger("pagedllm.quantization")

_KNOWN = {
    "load_in_4bit",
    "load_in_8bit",
    "_load_in_4bit",
    "_load_in_8bit",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "llm_int8_enable_fp32_cpu_offload",
    "llm_int8_has_fp16_weight",
    "llm_int8_skip_modules",
    "llm_int8_threshold",
}


class BitsAndBytesConfig(QuantizationConfig):
    name = "bitsandbytes"
    # Checkpoints name the layer state in ways only its own load format reads.
    load_format = "bitsandbytes"

    def __init__(
        self,
        *,
        serialized: bool,
        bits: int = 4,
        skip: list[str] | None = None,
        compute_dtype: str | None = None,
        threshold: float | None = None,
    ) -> None:
        self.serialized = serialized
        self.bits = bits
        self.skip = list(skip or [])
        self.compute_dtype = compute_dtype
        self.threshold = threshold
        # A QLoRA adapter's target_modules (and exclude_modules): the layers quantized
        # at load, when one is given.
        self.targets: list[str] | str | None = None
        self.excluded: list[str] | str | None = None
        self._told = False

    def use_qlora_adapter(self, adapter: str) -> None:
        """``--qlora-adapter-name-or-path``: quantize at load only the layers the adapter's
        ``target_modules`` name (vLLM's use of it), read from its ``adapter_config.json``."""
        if self.serialized:
            raise ConfigError(
                "--qlora-adapter-name-or-path chooses the layers quantized at load; this "
                "checkpoint is already quantized (its own config says which layers are)"
            )
        path = resolve_model_path(adapter)
        file = (path if path.is_dir() else path.parent) / "adapter_config.json"
        if not file.is_file():
            raise ConfigError(f"--qlora-adapter-name-or-path {adapter}: no adapter_config.json")
        config = json.loads(file.read_text(encoding="utf-8"))
        if config.get("peft_type", "LORA") != "LORA" or not config.get("target_modules"):
            raise ConfigError(
                f"--qlora-adapter-name-or-path {adapter}: not a LoRA adapter with target_modules"
            )
        for key in ("layers_to_transform", "layers_pattern"):
            if config.get(key) is not None:
                raise ConfigError(
                    f"--qlora-adapter-name-or-path {adapter}: adapters limited by {key} "
                    "are not read"
                )
        self.targets = config["target_modules"]
        self.excluded = config.get("exclude_modules")

    def _targeted(self, prefix: str) -> bool:
        """Whether peft would put the adapter on the layer at ``prefix``: a string is a
        regular expression over the whole name (``all-linear``: every layer), a list
        holds names or their last parts."""

        def matches(rule: list[str] | str | None) -> bool:
            if rule is None:
                return False
            if isinstance(rule, str):
                return rule == "all-linear" or re.fullmatch(rule, prefix) is not None
            return any(prefix == name or prefix.endswith("." + name) for name in rule)

        return self.targets is None or (matches(self.targets) and not matches(self.excluded))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BitsAndBytesConfig:
        """An empty ``config`` (``--quantization bitsandbytes`` on a float checkpoint)
        quantizes to 4-bit NF4 at load; a checkpoint's ``quantization_config`` (as
        transformers' ``BitsAndBytesConfig`` writes it) is read as it is written."""
        if not config:
            return cls(serialized=False)
        unknown = sorted(set(config) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown bitsandbytes settings {unknown}")
        four = bool(config.get("load_in_4bit", config.get("_load_in_4bit", False)))
        eight = bool(config.get("load_in_8bit", config.get("_load_in_8bit", False)))
        if four == eight:
            raise ValueError("the checkpoint must say load_in_4bit or load_in_8bit (one of them)")
        if config.get("llm_int8_has_fp16_weight"):
            raise ValueError(
                "llm_int8_has_fp16_weight: true keeps float weights for training; pagedllm "
                "reads int8 weights"
            )
        if config.get("llm_int8_enable_fp32_cpu_offload"):
            raise ValueError(
                "llm_int8_enable_fp32_cpu_offload: true (a device map that offloads layers "
                "to the cpu) is not read: pagedllm keeps the whole model on one device"
            )
        storage = config.get("bnb_4bit_quant_storage", "uint8")
        if four and storage != "uint8":
            raise ValueError(f"bnb_4bit_quant_storage {storage!r}: pagedllm reads uint8")
        return cls(
            serialized=True,
            bits=4 if four else 8,
            skip=config.get("llm_int8_skip_modules") or [],
            compute_dtype=config.get("bnb_4bit_compute_dtype") if four else None,
            threshold=config.get("llm_int8_threshold") if eight else None,
        )

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if left_in_floats(prefix, self.skip) or not self._targeted(prefix):
            return None
        if not self._told:
            self._told = True
            logger.info(
                "bitsandbytes %d-bit weights%s; activations stay in the model's dtype%s",
                self.bits,
                "" if self.serialized else " (NF4, quantized at load)",
                (
                    f" (LLM.int8's 8-bit activations with threshold {self.threshold} are not used)"
                    if self.bits == 8
                    else f" (the checkpoint's compute dtype {self.compute_dtype} is not used)"
                    if self.compute_dtype
                    else ""
                ),
            )
        return self.method_classes[self.bits](self)

    method_classes: ClassVar[dict[int, type[LinearMethod]]]


class Bnb4bitLinearMethod(LinearMethod):
    """A 4-bit layer: after loading, ``weight`` (uint8 ``[out, in / 2]``),
    ``weight_absmax`` and ``weight_code`` (see the module's docstring)."""

    def __init__(self, config: BitsAndBytesConfig) -> None:
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        if not self.config.serialized:
            layer.weight = checkpoint_param(output_size, input_size, dtype=params_dtype)
            return
        if input_size % ABSMAX_GROUP:
            raise ConfigError(
                f"4-bit bitsandbytes layer with {input_size} inputs: pagedllm reads rows "
                f"that are multiples of {ABSMAX_GROUP} weights"
            )
        layer.weight = checkpoint_param(output_size, input_size // 2, dtype=torch.uint8)
        layer.weight_absmax = checkpoint_param(output_size, input_size // ABSMAX_GROUP)
        layer.weight_code = checkpoint_param(16)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.serialized:
            return
        try:
            from bitsandbytes.functional import quantize_4bit
        except ImportError:
            raise ValueError(
                "--quantization bitsandbytes on a float checkpoint quantizes it with the "
                "bitsandbytes package: pip install bitsandbytes"
            ) from None
        weight = layer.weight.data
        packed, state = quantize_4bit(
            weight.contiguous(), blocksize=ABSMAX_GROUP, compress_statistics=True, quant_type="nf4"
        )
        parts = {"weight": packed}
        for key, value in state.as_dict(packed=True).items():
            parts[key] = value
        for name, tensor in read_4bit(layer.prefix, parts).items():
            setattr(layer, name, nn.Parameter(tensor, requires_grad=False))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_4bit(x, layer.weight, layer.weight_absmax, layer.weight_code, bias)


class Bnb8bitLinearMethod(LinearMethod):
    """An 8-bit layer: ``weight`` (int8 ``[out, in]``) and ``SCB`` (float32 ``[out]``);
    after loading, ``SCB / 127`` as ``int8_scale``."""

    def __init__(self, config: BitsAndBytesConfig) -> None:
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        layer.weight = checkpoint_param(output_size, input_size, dtype=torch.int8)
        layer.SCB = checkpoint_param(output_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int8_scale = int8_row_scale(layer.SCB.data)
        del layer.SCB

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_int8(x, layer.weight, layer.int8_scale, bias)


BitsAndBytesConfig.method_classes = {4: Bnb4bitLinearMethod, 8: Bnb8bitLinearMethod}
