"""``--load-format bitsandbytes``: safetensors checkpoints saved by transformers with
bitsandbytes quantization, or float ones that ``--quantization bitsandbytes`` quantizes at
load.

A 4-bit layer ``X`` is saved as ``X.weight`` (uint8, flat) and its quantization state
``X.weight.absmax``, ``X.weight.quant_map``, ``X.weight.nested_absmax``,
``X.weight.nested_quant_map`` and ``X.weight.quant_state.bitsandbytes__<type>`` (a JSON
description). This loader gathers each layer's pieces, wherever they are in the stream,
and hands the model the three tensors :func:`~pagedllm.kernels.quant_layouts.read_4bit`
makes of them. 8-bit layers (``X.weight`` int8, ``X.SCB``) pass through; their
``X.weight_format`` marker is checked and dropped. Everything else passes through.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.default import SafetensorsLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import ModelConfig

_WEIGHT = ".weight"


class BitsAndBytesLoader(SafetensorsLoader):
    # The quantization method whose checkpoints this format reads.
    quantization = "bitsandbytes"

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        from pagedllm.kernels.quant_layouts import (
            QUANT_STATE,
            needed_parts,
            read_4bit,
        )

        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in super().iter_weights(model_config):
            if name.endswith(".weight_format"):
                if tensor.numel() != 1 or int(tensor.reshape(-1)[0]) != 0:
                    raise ConfigError(
                        f"{name}: 8-bit weights in bitsandbytes' format "
                        f"{tensor.reshape(-1).tolist()}: pagedllm reads the row format (0)"
                    )
                continue
            if name.endswith(_WEIGHT) and tensor.dtype == torch.uint8:
                prefix, part = name.removesuffix(_WEIGHT), "weight"
            elif _WEIGHT + "." in name:
                prefix, _, part = name.partition(_WEIGHT + ".")
            else:
                yield name, tensor
                continue
            group = pending.setdefault(prefix, {})
            group[part] = tensor
            states = [p for p in group if p.startswith(QUANT_STATE)]
            if not states or not needed_parts(group[states[0]]) <= set(group):
                continue
            try:
                converted = read_4bit(prefix, pending.pop(prefix))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            for part_name, value in converted.items():
                yield f"{prefix}.{part_name}", value
        if pending:
            incomplete = {prefix: sorted(group) for prefix, group in sorted(pending.items())}
            shown = ", ".join(f"{p} has {parts}" for p, parts in list(incomplete.items())[:4])
            raise ConfigError(
                f"bitsandbytes 4-bit layers without their whole quantization state: {shown} "
                "(each needs weight, weight.absmax, weight.quant_map and "
                f"weight.{QUANT_STATE}<type>)"
            )
