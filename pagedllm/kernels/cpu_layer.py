"""A Llama-family (or Gemma 2 / 3) decoder layer as one native call (``csrc/cpu_layer.c``) for
decode steps on the CPU with GGUF weights or dense (safetensors) float32 / bfloat16 ones.

:func:`native_decoder_layer` inspects a built layer and returns a
:class:`NativeDecoderLayer` when every part qualifies (Q/K/V and gate/up each one fused
weight, a group's or as Phi-3's checkpoints fuse them, with the output and down projections
either all packed Q4_0/Q4_1/Q8_0 or all dense in the model's dtype; no biases but the Q/K/V
group's (Qwen2's), no LoRA, Q/K norms only as RMSNorms of each head (Qwen3's, Gemma 3's),
SiLU or GELU's tanh form (Gemma's) on the modules' kernel, RMSNorms of one weight offset (0,
or Gemma's 1) with Gemma's norms of the attention's and the MLP's outputs, scores
soft-capped or not (Gemma 2's), NeoX RoPE tables in float32; a float32 model, or a
bfloat16 one where the CPU has the attention kernel's bfloat16 cache, and for packed
weights the bfloat16 products), else None. Dense products are
:mod:`pagedllm.kernels.dense_cpu`'s small-row kernel, which the modules call for as many rows
(:func:`~pagedllm.kernels.dense_cpu.small_rows_max`), so a dense layer takes steps of at
most that many tokens; a bfloat16 one whose products the AMX kernel takes
(:mod:`pagedllm.kernels.dense_amx`, from four rows, as the modules do) up to its
:data:`~pagedllm.kernels.dense_amx.AMX_ROWS` (batched decode steps). Calling it runs the
layer for a step of at most :meth:`NativeDecoderLayer.max_tokens` tokens whose attention is
all in the paged-attention kernel (decodes and short chunks), and returns None for any other
step, which the module then computes op by op. The native call runs the very kernels of that
path in the same order, so both give bit-identical results (in batch-invariant mode too,
where both take the panel products at every row count).

The kernels sit below the plugins that build those parts, so they are recognised by what
they hold, not by class: a packed product by its GGML type (a fused group of packed layers,
pagedllm.plugins.quantization.gguf's ``PackedFusedLinear``, or a layer whose method holds
one, its ``GGUFLinearMethod``), a dense one by its float weight and no method, the cpu
device's attention step by its :class:`PagedMetadata`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from pagedllm.distributed.parallel_state import tp_size
from pagedllm.kernels.batch_invariant import batch_invariant
from pagedllm.kernels.cpu_ops import (
    GATED_KERNELS,
    MAX_GROUP,
    MAX_HEAD_DIM,
    SILU_KERNEL_MAX_ROWS,
    PagedMetadata,
    cpu_ops,
)
from pagedllm.kernels.dense_amx import AMX_ROWS, amx_kernels
from pagedllm.kernels.dense_cpu import dense_kernels, small_rows_max
from pagedllm.kernels.ggml_types import GGMLQuantizationType
from pagedllm.kernels.gguf_cpu import cpu_kernels
from pagedllm.kernels.gguf_matmul import FUSED_TYPES, fused_max_rows, int8_min_rows
from pagedllm.kernels.native import load_kernel_library

__all__ = ["NativeDecoderLayer", "native_decoder_layer"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# The most tokens a native bfloat16 step takes where the products have no row limit: its
# buffers are about 15 rows of the hidden size per token. A float32 step takes at most as
# many as the module path gives the SiLU kernel where it is not vectorised (past that the
# modules use torch's SiLU, and the two paths would no longer agree bit for bit). Where it
# is vectorised (AVX2 builds) the modules take it at any row count, so the paths would
# agree past that too; the limit is kept there as it was.
MAX_STEP_TOKENS = 1024
# The "GGML types" csrc/cpu_layer.c gives dense weights.
DENSE_TYPES = {torch.float32: -1, torch.bfloat16: -2}


class _StepArgs(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64),
        ("positions", _ptr),
        ("slot_mapping", _ptr),
        ("num_seqs", _i64),
        ("q_start", _ptr),
        ("q_end", _ptr),
        ("ctx_len", _ptr),
        ("block_tables", _ptr),
        ("bt_stride", _i64),
        ("int8", _i64),
        ("nthreads", _i64),
        ("invariant", _i64),
    ]


class _LayerArgs(ctypes.Structure):
    _fields_ = [
        *[(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")],
        *[(name, _ptr) for name in ("ln1", "ln2", "qkv", "o", "gate_up", "down")],
        *[(f"{name}_type", _i64) for name in ("qkv", "o", "gate_up", "down")],
        *[(f"{name}_row_bytes", _i64) for name in ("qkv", "o", "gate_up", "down")],
        ("cos_table", _ptr),
        ("sin_table", _ptr),
        ("table_stride", _i64),
        ("rot_dim", _i64),
        ("cache", _ptr),
        *[(name, _i64) for name in ("num_slots", "block_size", "window")],
        *[(name, _f32) for name in ("eps1", "eps2", "scale", "pad")],
        ("qkv_bias", _ptr),
        ("qkv_bias_bf16", _i64),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("eps_q", _f32),
        ("eps_k", _f32),
        *[(name, _f32) for name in ("norm_offset", "eps_post_attn", "eps_post_mlp", "pad2")],
        ("post_attn", _ptr),
        ("post_mlp", _ptr),
        ("activation", _i64),
        ("soft_cap", _f32),
        ("pad3", _f32),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel_library("cpu_layer")
    if lib is not None:
        for fn in (lib.pagedllm_llama_layer, lib.pagedllm_llama_layer_bf16):
            fn.argtypes = [_ptr, _ptr, _ptr, _ptr]
            fn.restype = ctypes.c_int
    return lib


def _packed(
    module: Any, sizes: list[int] | None = None, bias: bool = False
) -> tuple[torch.Tensor, int] | None:
    """(raw weight, GGML type) of a packed GGUF product of a fused type, bias-free unless
    ``bias`` (the Q/K/V group's, which the layer adds)."""
    if isinstance(getattr(module, "qtype", None), GGMLQuantizationType):  # (a fused group)
        if (module.bias is not None and not bias) or (sizes is not None and module.sizes != sizes):
            return None
        weight, qtype = module.weight, module.qtype
    elif (
        isinstance(getattr(getattr(module, "method", None), "qtype", None), GGMLQuantizationType)
        and sizes is None
    ):
        if module.bias is not None or getattr(module, "int4_perm", None) is not None:
            return None  # (a GPTQ layer whose columns are reordered: not a plain product)
        weight, qtype = module.weight, module.method.qtype
    else:
        return None
    if qtype not in FUSED_TYPES or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    return weight, int(qtype)


def _dense(
    module: Any, dtype: torch.dtype, sizes: list[int] | None = None, bias: bool = False
) -> tuple[torch.Tensor, int] | None:
    """(weight, dense type) of an unquantized product in ``dtype``, bias-free unless
    ``bias``: a fused group of plain layers (``sizes`` its parts) or a plain layer, whose
    product the modules take through :func:`pagedllm.kernels.batch_invariant.linear`."""
    if getattr(module, "method", None) is not None or getattr(module, "qtype", None) is not None:
        return None
    if (sizes is None) != (getattr(module, "sizes", None) is None):
        return None
    if sizes is not None and module.sizes != sizes:
        return None
    weight = getattr(module, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or (module.bias is not None and not bias)
        or weight.dtype != dtype
        or weight.dim() != 2
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
    ):
        return None
    return weight, DENSE_TYPES[dtype]


def _amx_fits(parts: dict[str, Any]) -> bool:
    """Whether the modules give every dense product of more than the small-row kernel's
    rows (up to ``AMX_ROWS``) to the AMX kernel, as the native layer then does."""
    kernels = amx_kernels()
    if kernels is None or not kernels.available:
        return False
    weights = [parts[name][0] for name in ("qkv", "o", "gate_up", "down")]
    return all(kernels.fits(w[:1], w) for w in weights)


def _plain_norm(norm: Any, dtype: torch.dtype, offset: float = 0.0) -> bool:
    """An RMSNorm (the modules' kernel) whose weights, of ``dtype``, are offset by
    ``offset``."""
    return (
        getattr(norm, "offset", None) == offset
        and norm.weight.dtype == dtype
        and norm.weight.is_contiguous()
    )


def _norms(layer: Any) -> dict[str, Any]:
    """The layer's norms by their role in csrc/cpu_layer.c: ``ln1`` before the attention,
    ``ln2`` before the MLP and, in Gemma's layers, ``post_attn`` and ``post_mlp`` of the
    attention's and the MLP's outputs."""
    if getattr(layer, "pre_feedforward_layernorm", None) is not None:
        return {
            "ln1": layer.input_layernorm,
            "ln2": layer.pre_feedforward_layernorm,
            "post_attn": layer.post_attention_layernorm,
            "post_mlp": layer.post_feedforward_layernorm,
        }
    return {"ln1": layer.input_layernorm, "ln2": layer.post_attention_layernorm}


def _qk_norms(attn: Any) -> tuple[Any, Any] | None:
    """The attention's norms of each query and each key head (Qwen3's, Gemma 3's), or None."""
    if not getattr(attn, "has_qk_norm", False):
        return None
    q_name, k_name = attn.qk_norm_names
    return getattr(attn, q_name), getattr(attn, k_name)


class NativeDecoderLayer:
    def __init__(
        self,
        lib: ctypes.CDLL,
        layer: Any,
        rotary: Any,
        parts: dict[str, Any],
        bias: torch.Tensor | None,
        norms: dict[str, Any],
        qk_norms: tuple[Any, Any] | None,
    ) -> None:
        """``parts``, ``bias``, ``norms`` (:func:`_norms`) and ``qk_norms``
        (:func:`_qk_norms`): the layer's, as :func:`native_decoder_layer` checked them."""
        attn, mlp = layer.self_attn, layer.mlp
        self.lib = lib
        # float32, or bfloat16 (hidden states, norms and KV cache; AVX512-BF16 products).
        self.dtype = layer.input_layernorm.weight.dtype
        self.call = (
            lib.pagedllm_llama_layer_bf16
            if self.dtype == torch.bfloat16
            else lib.pagedllm_llama_layer
        )
        self.layer_index = attn.attn.layer_index
        self.rotary = rotary
        self._max_tokens: int | None = None
        # Steps computed natively (for tests and profiles).
        self.steps = 0
        # Kept so the pointers below stay valid (and are checked against on every call).
        self.tensors = [
            *(norm.weight for norm in norms.values()),
            *(parts[name][0] for name in ("qkv", "o", "gate_up", "down")),
            rotary.cos,
            rotary.sin,
        ]
        if bias is not None:
            self.tensors.append(bias)
        if qk_norms:
            self.tensors += [norm.weight for norm in qk_norms]
        self.pointers = [t.data_ptr() for t in self.tensors]
        args = _LayerArgs()
        args.hidden = layer.input_layernorm.weight.shape[0]
        args.heads, args.kv_heads, args.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        args.inter = mlp.down_proj.input_size
        args.ln1, args.eps1 = norms["ln1"].weight.data_ptr(), norms["ln1"].eps
        args.ln2, args.eps2 = norms["ln2"].weight.data_ptr(), norms["ln2"].eps
        if "post_attn" in norms:
            args.post_attn = norms["post_attn"].weight.data_ptr()
            args.post_mlp = norms["post_mlp"].weight.data_ptr()
            args.eps_post_attn, args.eps_post_mlp = norms["post_attn"].eps, norms["post_mlp"].eps
        args.norm_offset = norms["ln1"].offset
        args.activation = GATED_KERNELS[mlp.gated_kernel]
        args.soft_cap = attn.attn.logits_soft_cap or 0.0
        self.dense = parts["qkv"][1] < 0
        # (bfloat16 dense weights the AMX kernel takes: steps of its rows too, see max_tokens)
        self.amx = self.dense and self.dtype == torch.bfloat16 and _amx_fits(parts)
        for name in ("qkv", "o", "gate_up", "down"):
            weight, qtype = parts[name]
            setattr(args, name, weight.data_ptr())
            setattr(args, f"{name}_type", qtype)
            setattr(args, f"{name}_row_bytes", weight.shape[-1] * weight.element_size())
        args.cos_table, args.sin_table = rotary.cos.data_ptr(), rotary.sin.data_ptr()
        args.table_stride, args.rot_dim = rotary.cos.stride(0), rotary.rotary_dim
        args.scale = attn.attn.scale
        args.window = attn.attn.sliding_window or 0
        if bias is not None:
            args.qkv_bias, args.qkv_bias_bf16 = bias.data_ptr(), int(bias.dtype == torch.bfloat16)
        if qk_norms:
            args.q_norm, args.k_norm = (norm.weight.data_ptr() for norm in qk_norms)
            args.eps_q, args.eps_k = (norm.eps for norm in qk_norms)
        self.args = args

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: Any
    ) -> torch.Tensor | None:
        if (
            not isinstance(metadata, PagedMetadata)
            or metadata.prefills
            or hidden.dim() != 2
            or hidden.shape[0] > self.max_tokens()
            or hidden.dtype != self.dtype
            or not hidden.is_contiguous()
            or [t.data_ptr() for t in self.tensors] != self.pointers
        ):
            return None
        # What is the same for every layer of a step is worked out by its first layer.
        step = metadata.native_step
        if step is None or step[0] is not positions:
            step = metadata.native_step = (
                positions,
                *self._step_args(positions, metadata),
                self._step_ok(),
            )
        if not step[-1]:
            return None
        cache = metadata.kv_caches[self.layer_index]
        if cache.dtype != self.dtype or not cache.is_contiguous():
            return None
        args = self.args
        args.cache = cache.data_ptr()
        args.num_slots = cache.shape[1] * cache.shape[2]
        args.block_size = cache.shape[2]
        out = torch.empty_like(hidden)
        status = self.call(
            ctypes.addressof(args), ctypes.addressof(step[1]), hidden.data_ptr(), out.data_ptr()
        )
        if status == -2:
            raise MemoryError("the native decoder layer could not allocate its buffers")
        if status != 0:
            raise RuntimeError(f"the native decoder layer failed ({status})")
        self.steps += 1
        return out

    def _step_ok(self) -> bool:
        """Whether this step's products are the modules' ones."""
        if self.dense:
            # (batch-invariant bfloat16: the modules' panels in bfloat16 pairs, which the
            # layer calls; without AVX512-BF16 they widen the rows, which it does not)
            kernels = cpu_kernels()
            bf16_panels = kernels is not None and kernels.bf16
            return self.dtype != torch.bfloat16 or not batch_invariant() or bf16_panels
        # (the modules' 8-bit products widen bfloat16 rows: not here)
        return self.dtype != torch.bfloat16 or self._int8_panels()

    def _int8_panels(self) -> bool:
        """Whether this layer's 8-bit products (if any) are the panel kernel's, which the
        bfloat16 layer calls; without it the modules widen bfloat16 rows for the untiled
        one, which it does not."""
        from pagedllm.kernels.gguf_cpu import cpu_kernels

        kernels = cpu_kernels()
        return int8_min_rows(self.dtype) is None or (kernels is not None and kernels.q8_panels)

    def max_tokens(self) -> int:
        """The most tokens of a step this layer takes natively."""
        if self._max_tokens is None:
            if self.dense:
                limit = small_rows_max(self.dtype)
                if self.amx:
                    limit = AMX_ROWS[-1]
            else:
                limit = fused_max_rows() or MAX_STEP_TOKENS
            bf16 = self.dtype == torch.bfloat16
            self._max_tokens = limit if bf16 else min(limit, SILU_KERNEL_MAX_ROWS)
        return self._max_tokens

    def _step_args(self, positions: torch.Tensor, metadata: Any) -> tuple[Any, ...]:
        if positions.dtype != torch.long or not positions.is_contiguous():
            raise TypeError("positions must be a contiguous int64 tensor")
        self.rotary.check_positions(positions)
        ranges, tables = metadata.seq_ranges, metadata.block_tables
        step = _StepArgs()
        step.tokens = positions.shape[0]
        step.positions = positions.data_ptr()
        step.slot_mapping = metadata.slot_mapping.data_ptr()
        step.num_seqs = ranges.shape[1]
        step.q_start, step.q_end = ranges[0].data_ptr(), ranges[1].data_ptr()
        step.ctx_len = ranges[2].data_ptr()
        step.block_tables, step.bt_stride = tables.data_ptr(), tables.stride(0)
        # From how many rows the products take 8-bit activations (0: never).
        step.int8 = int8_min_rows(self.dtype) or 0
        step.nthreads = torch.get_num_threads()
        # Batch-invariant mode: the products in panels at every row count, as the modules'.
        step.invariant = int(batch_invariant())
        # The tensors whose pointers the arguments hold stay referenced with them.
        return step, ranges, tables, metadata.slot_mapping


def native_decoder_layer(layer: Any, rotary: Any) -> NativeDecoderLayer | None:
    """The native form of a built Llama-family decoder layer, or None where it does not
    apply (see the module docstring; never on several tensor-parallel ranks, whose layers
    end in all-reduces)."""
    if tp_size() > 1:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(mlp, "gated_kernel", None) not in GATED_KERNELS:
        return None
    if attn.head_dim > MAX_HEAD_DIM or attn.num_heads // attn.num_kv_heads > MAX_GROUP:
        return None
    dtype = layer.input_layernorm.weight.dtype
    if dtype not in DENSE_TYPES:
        return None
    # (every norm of the layer with the first one's weight offset)
    offset = getattr(layer.input_layernorm, "offset", None)
    if not isinstance(offset, float):
        return None  # (not an RMSNorm)
    qk_norms = _qk_norms(attn)
    # (Qwen3's and Gemma 3's norms of each head: RMSNorms over head_dim)
    if qk_norms is not None and not all(
        _plain_norm(norm, dtype, offset) and tuple(norm.weight.shape) == (attn.head_dim,)
        for norm in qk_norms
    ):
        return None
    if any(getattr(module, "lora", None) is not None for module in layer.modules()):
        return None  # (the layer adds no LoRA deltas)
    ops = cpu_ops()
    # The bfloat16 layer needs a bfloat16 cache the attention kernel reads.
    if dtype == torch.bfloat16 and (ops is None or not ops.bf16_cache_ok(attn.head_dim)):
        return None
    norms = _norms(layer)
    if not all(_plain_norm(norm, dtype, offset) for norm in norms.values()):
        return None
    cos = getattr(rotary, "cos", None)
    if cos is None or cos.dtype != torch.float32 or not cos.is_contiguous():
        return None
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    qkv = _fused(getattr(attn, "qkv", None), getattr(attn, "qkv_proj", None))
    gate_up = _fused(getattr(mlp, "gate_up", None), getattr(mlp, "gate_up_proj", None))
    if qkv is None or gate_up is None:
        return None
    inter = mlp.down_proj.input_size
    (qkv_module, qkv_grouped), (gate_up_module, gate_up_grouped) = qkv, gate_up
    rows = {"qkv": q_size + 2 * kv_size, "gate_up": 2 * inter}
    # (the sizes a group knows, checked; a layer's rows are checked below)
    qkv_sizes = [q_size, kv_size, kv_size] if qkv_grouped else None
    gate_up_sizes = [inter, inter] if gate_up_grouped else None
    parts = {
        "qkv": _packed(qkv_module, qkv_sizes, bias=True),
        "o": _packed(attn.o_proj),
        "gate_up": _packed(gate_up_module, gate_up_sizes),
        "down": _packed(mlp.down_proj),
    }
    if any(part is None for part in parts.values()):
        parts = {
            "qkv": _dense(qkv_module, dtype, qkv_sizes, bias=True),
            "o": _dense(attn.o_proj, dtype),
            "gate_up": _dense(gate_up_module, dtype, gate_up_sizes),
            "down": _dense(mlp.down_proj, dtype),
        }
        if any(part is None for part in parts.values()) or dense_kernels() is None:
            return None
    elif dtype == torch.bfloat16:
        # (the bfloat16 layer's packed products: AVX512-BF16)
        kernels = cpu_kernels()
        if kernels is None or not kernels.bf16:
            return None
    if any(parts[name][0].shape[0] != n for name, n in rows.items()):
        return None
    bias = qkv_module.bias
    if bias is not None and (
        bias.dtype not in DENSE_TYPES or bias.device.type != "cpu" or not bias.is_contiguous()
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    return NativeDecoderLayer(lib, layer, rotary, parts, bias, norms, qk_norms)


def _fused(group: Any, layer: Any) -> tuple[Any, bool] | None:
    """``(module, grouped)``: the module computing a fused product, a group's one run
    (``grouped``: it knows its parts' sizes), or else a layer whose weight holds the
    parts' rows (Phi-3's ``qkv_proj``, ``gate_up_proj``); None: a group of several runs."""
    if group is not None:
        return (group.runs[0], True) if len(group.runs) == 1 else None
    return None if layer is None else (layer, False)
