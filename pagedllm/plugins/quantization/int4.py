"""``--quantization gptq`` and ``awq`` (and vLLM's names for their fast kernels,
``gptq_marlin`` and ``awq_marlin``): 4-bit checkpoints with a scale and a zero point per
group of input columns, read in the layouts AutoGPTQ / GPTQModel and AutoAWQ write.

- GPTQ: ``qweight`` int32 ``[in / 8, out]`` (eight 4-bit values of consecutive input
  columns per int32, lowest bits first), ``qzeros`` int32 ``[groups, out / 8]`` (zero
  points minus one, packed along the output columns), ``scales`` ``[groups, out]`` and
  ``g_idx`` ``[in]`` (each input column's group: with ``desc_act`` the groups follow the
  quantization order, not the columns);
- AWQ (GEMM layout): ``qweight`` int32 ``[in, out / 8]`` packed along the output columns
  in AutoAWQ's order (0, 2, 4, 6, 1, 3, 5, 7), ``qzeros`` ``[groups, out / 8]`` likewise
  (the zero points themselves), ``scales`` ``[groups, out]``; input column ``i`` is in
  group ``i // group_size``.

Weight ``[o, i]`` is ``scale[g, o] * (q[i, o] - zero[g, o])``. At load the weights are
repacked, exactly, into a GGML type the GGUF kernels compute with (blocks of 32 input
columns with an fp16 scale): Q4_0 where every zero point is 8 (symmetric GPTQ, 4.5 bits
a weight), else Q8_0 holding ``q - zero`` (8.5 bits a weight). With ``desc_act`` the input
columns are stored sorted by group (so that groups are contiguous) and each product
gathers the activations in that order. A layout the blocks cannot hold exactly (groups
not a multiple of 32 columns, scales that are not fp16 values) is dequantized to the
model's dtype instead, with a warning.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.interfaces import LinearMethod, QuantizationConfig
from pagedllm.core.layers.linear import restack_rows
from pagedllm.kernels.batch_invariant import linear
from pagedllm.kernels.ggml_types import GGMLQuantizationType
from pagedllm.kernels.gguf_matmul import gguf_linear
from pagedllm.plugins.quantization.common import checkpoint_param, left_in_floats
from pagedllm.plugins.quantization.gguf import GGUFLinearMethod, PackedFusedLinear

logger = logging.getLogger("pagedllm.quantization")

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of each nibble, AutoAWQ's packing


def unpack_int32(
    packed: torch.Tensor,
    dim: int,
    bits: int = 4,
    count: int | None = None,
    order: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed into int32 ``[r, c]`` along ``dim`` (lowest
    bits first), as uint8: ``[r * n, c]`` for ``dim`` 0 (field j of row r is row
    ``n * r + j``), ``[r, c * n]`` for ``dim`` 1 (column ``n * c + order[j]``), with
    ``n = 32 // bits``; the first ``count`` rows or columns where padding follows."""
    per = 32 // bits
    shifts = torch.arange(0, per * bits, bits, dtype=torch.int32)
    fields = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    if order is not None:
        fields = fields[..., [order.index(k) for k in range(per)]]
    if dim == 0:
        return fields.movedim(-1, 1).reshape(-1, packed.shape[1])[:count]
    return fields.reshape(packed.shape[0], -1)[:, :count]


def _f16_exact(scales: torch.Tensor) -> bool:
    return bool(torch.equal(scales.half().float(), scales.float()))


def repack_to_gguf(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    groups: torch.Tensor,
    bits: int = 4,
) -> tuple[torch.Tensor, GGMLQuantizationType] | None:
    """GGML rows ``[out, row_bytes]`` holding exactly ``scales[g, o] * (q[i, o] -
    zeros[g, o])`` for unsigned ``bits``-bit ``q`` ``[in, out]`` and input groups
    ``groups`` ``[in]`` (which must be contiguous runs), or None where blocks of 32
    columns cannot hold it: Q4_0 for 4 bits with every zero point 8, else Q8_0 when
    every ``q - zero`` fits in 8 bits."""
    in_features, out_features = q.shape
    if in_features % 32 or not _f16_exact(scales):
        return None
    block_groups = groups.reshape(-1, 32)
    if not torch.equal(block_groups, block_groups[:, :1].expand(-1, 32)):
        return None  # a block of 32 columns spans two groups
    values = (q.to(torch.int16) - zeros[groups].to(torch.int16)).T.contiguous()  # [out, in]
    if int(values.min()) < -128 or int(values.max()) > 127:
        return None
    d = scales[block_groups[:, 0]].T.contiguous().half()  # [out, in / 32]
    blocks = in_features // 32
    d_bytes = d.view(torch.uint8).reshape(out_features, blocks, 2)
    if bits == 4 and bool((zeros == 8).all()):
        nibbles = (values + 8).to(torch.uint8).reshape(out_features, blocks, 2, 16)
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # low: 0..15, high: 16..31
        qtype = GGMLQuantizationType.Q4_0
    else:
        packed = values.to(torch.int8).view(torch.uint8).reshape(out_features, blocks, 32)
        qtype = GGMLQuantizationType.Q8_0
    rows = torch.cat([d_bytes, packed], dim=2).reshape(out_features, -1).contiguous()
    return rows, qtype


class _Int4Config(QuantizationConfig):
    """What GPTQ and AWQ share: 4 bits, a group size, modules left in floats."""

    # quantization_config keys that describe how the checkpoint was made, not how to read it.
    _INERT: ClassVar[frozenset[str]] = frozenset()
    _READ: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, group_size: int, ignored: list[str]) -> None:
        self.group_size = group_size
        self.ignored = ignored
        self._warned = False

    @classmethod
    def _common(cls, config: dict[str, Any]) -> tuple[int, list[str]]:
        if not config:
            raise ValueError(
                f"{cls.name} needs a checkpoint quantized with it (its config.json's "
                "quantization_config); it does not quantize float weights"
            )
        unknown = sorted(set(config) - cls._READ - cls._INERT)
        if unknown:
            raise ValueError(f"unknown {cls.name} settings {unknown}")
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"{bits}-bit weights: pagedllm reads 4-bit {cls.name} checkpoints")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or (group < 1 and group != -1):
            raise ValueError(f"group_size {group!r} is neither a positive int nor -1")
        ignored = list(config.get("modules_to_not_convert") or [])
        return group, ignored

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if left_in_floats(prefix, self.ignored):
            return None
        return self.method_cls(self)

    method_cls: ClassVar[type]


class Int4LinearMethod(GGUFLinearMethod):
    """Registers the checkpoint's tensors; after loading, one GGML weight (see the
    module's docstring; ``qtype`` is its type from then on, None where it runs
    dequantized) and, with ``desc_act``, the column order. Without a column order the
    layer is a GGUF layer like any other, and the GGUF kernels' fused paths (the native
    decoder layer) take it."""

    bits = 4  # (of the checkpoint's values: compressed-tensors' may have 8)

    def __init__(self, config: _Int4Config) -> None:
        super().__init__(None)  # (the type is known once the weights are repacked)
        self.config = config

    def _groups(self, in_features: int) -> int:
        size = self.config.group_size
        return 1 if size == -1 else -(-in_features // size)

    @abstractmethod
    def _unpack(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """``(q [in, out], zeros [groups, out], scales [groups, out], groups [in])``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales, groups = self._unpack(layer)
        in_features, out_features = q.shape
        for name, _ in list(layer.named_parameters(recurse=False)):
            if name != "bias":  # (the checkpoint's tensors: repacked below)
                delattr(layer, name)
        perm = None
        if bool((groups[1:] < groups[:-1]).any()):
            perm = torch.argsort(groups, stable=True)
            q, groups = q[perm], groups[perm]
        layer.int4_perm = perm
        layer.gguf_shape = (out_features, in_features)
        fused = getattr(layer, "int4_fused", None)
        repacked = repack_to_gguf(q, zeros, scales, groups, self.bits)
        if repacked is None:
            if not self.config._warned:
                self.config._warned = True
                logger.warning(
                    "%s weights whose groups are not blocks of 32 columns (or whose scales "
                    "are not fp16 values) run dequantized, in the model's dtype",
                    self.config.name,
                )
            dtype = layer.int4_dtype
            values = (q.float() - zeros[groups].float()) * scales[groups].float()
            layer.weight = nn.Parameter(values.T.contiguous().to(dtype), requires_grad=False)
            self.qtype = None
        else:
            rows, self.qtype = repacked
            layer.weight = nn.Parameter(rows, requires_grad=False)
        if fused is not None:
            fused.layer_ready()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.int4_perm is not None:
            x = x.index_select(-1, layer.int4_perm)
        if self.qtype is None:
            return linear(x, layer.weight, bias)
        out_features, in_features = layer.gguf_shape
        return gguf_linear(x, layer.weight, self.qtype, out_features, in_features, bias)

    def fuse(self, layers: Sequence[nn.Module]) -> nn.Module | None:
        """Layers reading the same input (Q/K/V, gate/up), all or none with a bias, as one
        product once loaded: see :class:`Int4FusedLinear`."""
        if len({layer.bias is not None for layer in layers}) != 1:
            return None
        if any(layer.method.config is not self.config for layer in layers):
            return None
        return Int4FusedLinear(layers)


class Int4FusedLinear(PackedFusedLinear):
    """GPTQ / AWQ layers reading the same input. Once the last of them is repacked, those
    of one GGML type without a column order become one packed weight (theirs are its row
    slices): a GGUF fused product like any other. Otherwise each is computed on its own."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        nn.Module.__init__(self)  # (PackedFusedLinear's state is built in layer_ready)
        self.layers = tuple(layers)  # (not registered: they live where the model put them)
        self.sizes = [layer.output_size for layer in layers]
        self.in_features = layers[0].input_size
        self.qtype = None  # None: computed layer by layer
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self._waiting = len(layers)
        for layer in layers:
            layer.int4_fused = self

    def layer_ready(self) -> None:
        self._waiting -= 1
        if self._waiting:
            return
        qtypes = {layer.method.qtype for layer in self.layers}
        if len(qtypes) != 1 or None in qtypes:
            return
        if any(layer.int4_perm is not None for layer in self.layers):
            return
        self.weight = restack_rows(self.layers, self.sizes, "weight")
        if self.layers[0].bias is not None:
            self.bias = restack_rows(self.layers, self.sizes, "bias")
        self.qtype = qtypes.pop()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.qtype is None:
            return [layer(x) for layer in self.layers]
        return super().forward(x)


class GPTQLinearMethod(Int4LinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        if input_size % PACK or output_size % PACK:
            raise ValueError(
                f"{self.config.name}: a {input_size}x{output_size} layer is not a multiple "
                f"of {PACK} 4-bit values"
            )
        groups = self._groups(input_size)
        layer.qweight = checkpoint_param(input_size // PACK, output_size, dtype=torch.int32)
        layer.qzeros = checkpoint_param(groups, output_size // PACK, dtype=torch.int32)
        layer.scales = checkpoint_param(groups, output_size, dtype=torch.float32)
        layer.g_idx = checkpoint_param(input_size, dtype=torch.int32)
        layer.int4_dtype = params_dtype

    def _unpack(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        q = unpack_int32(layer.qweight.data, dim=0)
        zeros = unpack_int32(layer.qzeros.data, dim=1).to(torch.int16) + 1  # (stored minus one)
        groups = layer.g_idx.data.long()
        if int(groups.min()) < 0 or int(groups.max()) >= zeros.shape[0]:
            raise ValueError(f"{self.config.name}: g_idx names groups the layer does not have")
        return q, zeros, layer.scales.data.float(), groups


class AWQLinearMethod(Int4LinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        if output_size % PACK:
            raise ValueError(
                f"awq: a layer of {output_size} outputs is not a multiple of {PACK} values"
            )
        groups = self._groups(input_size)
        layer.qweight = checkpoint_param(input_size, output_size // PACK, dtype=torch.int32)
        layer.qzeros = checkpoint_param(groups, output_size // PACK, dtype=torch.int32)
        layer.scales = checkpoint_param(groups, output_size, dtype=torch.float32)
        layer.int4_dtype = params_dtype

    def _unpack(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        q = unpack_int32(layer.qweight.data, dim=1, order=AWQ_ORDER)
        zeros = unpack_int32(layer.qzeros.data, dim=1, order=AWQ_ORDER).to(torch.int16)
        in_features = q.shape[0]
        size = in_features if self.config.group_size == -1 else self.config.group_size
        groups = torch.arange(in_features) // size
        return q, zeros, layer.scales.data.float(), groups


class GPTQConfig(_Int4Config):
    name = "gptq"
    method_cls = GPTQLinearMethod
    _READ = frozenset({"bits", "group_size", "desc_act", "sym", "modules_to_not_convert"})
    _INERT = frozenset(
        {
            "damp_percent",
            "damp_auto_increment",
            "true_sequential",
            "static_groups",
            "model_name_or_path",
            "model_file_base_name",
            "is_marlin_format",
            "quantizer",
            "checkpoint_format",
            "lm_head",
            "meta",
            "mse",
            "dataset",
            "tokenizer",
            "use_exllama",
            "exllama_config",
            "use_cuda_fp16",
            "max_input_length",
            "backend",
            "cache_block_outputs",
            "module_name_preceding_first_block",
            "batch_size",
            "pad_token_id",
            "block_name_to_quantize",
            "use_marlin",
            "sym_quant",
        }
    )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        group, ignored = cls._common(config)
        if config.get("checkpoint_format", "gptq") not in ("gptq",):
            raise ValueError(
                f"checkpoint_format {config['checkpoint_format']!r}: pagedllm reads the "
                "'gptq' layout (zero points stored minus one)"
            )
        if config.get("is_marlin_format") or config.get("lm_head"):
            raise ValueError(
                "this checkpoint stores marlin-packed or quantized lm_head weights, which "
                "pagedllm does not read"
            )
        return cls(group, ignored)


class AWQConfig(_Int4Config):
    name = "awq"
    method_cls = AWQLinearMethod
    _READ = frozenset(
        {"bits", "w_bit", "group_size", "q_group_size", "zero_point", "version"}
        | {"modules_to_not_convert"}
    )
    _INERT = frozenset({"backend", "do_fuse", "fuse_max_seq_len", "exllama_config"})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        group, ignored = cls._common(config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r}: pagedllm reads the GEMM layout")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points is not a layout pagedllm reads")
        return cls(group, ignored)


class GPTQMarlinConfig(GPTQConfig):
    """vLLM's name for GPTQ checkpoints run with its Marlin kernels: the same
    checkpoints, computed here as ``gptq`` is."""

    name = "gptq_marlin"
    checkpoint_methods = ("gptq",)


class AWQMarlinConfig(AWQConfig):
    name = "awq_marlin"
    checkpoint_methods = ("awq",)
