"""ctypes bindings of ``csrc/cpu_ops.c``: RMSNorm (with the residual add), NeoX rotary
embedding, SiLU·mul, paged attention and the sampling search (softmax, cumulative sum and
inverse CDF in one pass), for float32 tensors on the CPU (the elementwise
ones for bfloat16 too, rounded where the torch reference in bfloat16 rounds).

:func:`cpu_ops` returns the bindings, or None when the library cannot be built (or
``PAGEDLLM_DISABLE_CPU_KERNELS=1``); callers then use the torch references in
:mod:`pagedllm.kernels.norms`, :mod:`~pagedllm.kernels.rotary` and
:mod:`~pagedllm.kernels.attention`. Each binding states what it accepts (float32, last
dimension dense); :meth:`CpuOps.rows_ok` checks it for callers that dispatch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.kernels.native import load_kernel_library

if TYPE_CHECKING:
    from pagedllm.core.attention.metadata import PrefillSequence

__all__ = [
    "BF16_HEAD_DIMS",
    "GATED_ACTIVATIONS",
    "GATED_KERNELS",
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "SILU_KERNEL_MAX_ROWS",
    "CpuOps",
    "PagedMetadata",
    "cpu_ops",
]

# Limits of the paged-attention kernel (csrc/cpu_ops.c).
MAX_HEAD_DIM = 512
MAX_GROUP = 16
# Head sizes whose bfloat16 cache the kernel reads (its AVX-512 register tiles).
BF16_HEAD_DIMS = frozenset({16, 32, 64, 128, 256})
# The most float32 rows the models give the SiLU kernel where it is not vectorised (past
# that torch's vectorised SiLU is faster; CpuOps.silu_vector: no limit); the native
# decoder layer (pagedllm.kernels.cpu_layer) keeps to it too, so that both paths agree bit
# for bit.
SILU_KERNEL_MAX_ROWS = 64
# The kernels of act(gate) * up, by the name of the activations they compute
# (transformers' names; GELU's tanh approximation is Gemma's): the models' gated MLPs call
# them (pagedllm.plugins.models.llama.gated_activation), as does the native decoder layer.
# The float32 ones are vectorised together (CpuOps.silu_vector) and keep to
# SILU_KERNEL_MAX_ROWS alike where they are not.
GATED_KERNELS = {"silu_mul": 0, "gelu_tanh_mul": 1}
GATED_ACTIVATIONS = {"silu": "silu_mul", "swish": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}


@dataclasses.dataclass(slots=True)
class PagedMetadata:
    """A step as the paged-attention kernel takes it (built by the cpu device's backend,
    pagedllm.plugins.devices.cpu_attention; read by the native decoder layer too)."""

    num_tokens: int
    # Cache slot of every token of the flat batch.
    slot_mapping: torch.Tensor
    # The kernel's requests: int64 [3, S] (first token, end token, context length) and
    # their block tables, int32 [S, max_blocks].
    seq_ranges: torch.Tensor
    block_tables: torch.Tensor
    # Longer prefills, through SDPA.
    prefills: list[PrefillSequence]
    kv_caches: list[torch.Tensor]
    ops: CpuOps
    backend: Any = None
    # Per-step arguments of the native decoder layer (pagedllm.kernels.cpu_layer), built
    # by the first layer that runs it.
    native_step: Any = None


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a tensor viewed as ``[rows, last dim]``."""
    if x.dim() == 1:
        return 1, x.shape[0]
    return x.numel() // x.shape[-1], x.stride(-2)


class CpuOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        lib.pagedllm_rms_norm.argtypes = [
            ptr,
            i64,
            ptr,
            ptr,
            ptr,
            f32,
            f32,
            ptr,
            i64,
            i64,
            i64,
            i32,
        ]
        lib.pagedllm_rms_norm.restype = None
        lib.pagedllm_rotary_neox.argtypes = [
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i64,
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            i32,
        ]
        lib.pagedllm_rotary_neox.restype = None
        for name in GATED_KERNELS:
            gated = getattr(lib, f"pagedllm_{name}")
            gated.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i32]
            gated.restype = None
        # The bfloat16 forms take the same arguments.
        for name in ("rms_norm", "rotary_neox", *GATED_KERNELS):
            bf16 = getattr(lib, f"pagedllm_{name}_bf16")
            bf16.argtypes = getattr(lib, f"pagedllm_{name}").argtypes
            bf16.restype = None
        lib.pagedllm_paged_attention.argtypes = [
            ptr,
            i64,
            ptr,
            i64,
            ptr,
            i64,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            f32,
            i64,
            ptr,
            i64,
            i32,
            f32,
        ]
        lib.pagedllm_paged_attention.restype = i32
        lib.pagedllm_paged_attention_bf16.argtypes = lib.pagedllm_paged_attention.argtypes
        lib.pagedllm_paged_attention_bf16.restype = i32
        lib.pagedllm_sample_inverse_cdf.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32]
        lib.pagedllm_sample_inverse_cdf.restype = i32
        lib.pagedllm_attention_bf16_cache.argtypes = []
        lib.pagedllm_attention_bf16_cache.restype = i32
        self.bf16_cache = bool(lib.pagedllm_attention_bf16_cache())
        lib.pagedllm_attention_bf16_products.argtypes = []
        lib.pagedllm_attention_bf16_products.restype = i32
        self._bf16_products = bool(lib.pagedllm_attention_bf16_products())
        lib.pagedllm_silu_vector.argtypes = []
        lib.pagedllm_silu_vector.restype = i32
        # Whether the float32 SiLU and GELU kernels are vectorised (then faster than torch's
        # activation and product at any row count: SiLU, 2048 rows of SmolLM2's 1536 on
        # Zen 3, 8.1 ms / 13.0)
        self.silu_vector = bool(lib.pagedllm_silu_vector())
        self.lib = lib

    @staticmethod
    def rows_ok(x: torch.Tensor) -> bool:
        """Whether ``x`` is a float32 or bfloat16 CPU tensor of evenly strided, dense rows:
        contiguous, or 2-D with a dense last dimension."""
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu"
            and (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1))
        )

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        """RMSNorm of the rows of ``x`` (``[..., h]``, see :meth:`rows_ok`); ``weight``
        contiguous, of ``x``'s dtype; ``offset`` is added to it (Gemma)."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x, None, None, weight, eps, offset, out)
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, rms_norm(residual + x))``; ``residual`` contiguous, of the
        shape and dtype of ``x``."""
        total = torch.empty(x.shape, dtype=x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x, residual, total, weight, eps, offset, out)
        return total, out

    def _rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        total: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        out: torch.Tensor,
    ) -> None:
        h = x.shape[-1]
        rows, x_stride = _rows(x)
        if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            raise TypeError("rms_norm takes x, residual and weight of one dtype")
        self._kernel("rms_norm", x)(
            x.data_ptr(),
            x_stride,
            None if residual is None else residual.data_ptr(),
            None if total is None else total.data_ptr(),
            weight.data_ptr(),
            offset,
            eps,
            out.data_ptr(),
            h,
            rows,
            h,
            torch.get_num_threads(),
        )

    def rotary_neox_(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary_dim: int,
    ) -> None:
        """Rotates ``query`` ``[T, heads, d]`` and ``key`` ``[T, kv_heads, d]`` in place
        (heads adjacent, tokens evenly strided) with rows ``positions`` of ``cos``/``sin``
        (``[max_positions, rotary_dim]``, contiguous)."""
        tokens, heads, head_dim = query.shape
        if key.dtype != query.dtype or cos.dtype != torch.float32:
            raise TypeError("rotary_neox_ takes query and key of one dtype, float32 tables")
        self._kernel("rotary_neox", query)(
            query.data_ptr(),
            query.stride(0),
            heads,
            key.data_ptr(),
            key.stride(0),
            key.shape[1],
            head_dim,
            positions.data_ptr(),
            tokens,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            rotary_dim,
            torch.get_num_threads(),
        )

    def gated_mul(self, kernel: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` for ``[T, n]`` rows (each evenly strided, one dtype) by one of
        :data:`GATED_KERNELS` (``silu_mul``, ``gelu_tanh_mul``)."""
        if kernel not in GATED_KERNELS:
            raise ValueError(f"no gated kernel {kernel!r}")
        tokens, n = gate.shape
        if up.dtype != gate.dtype:
            raise TypeError(f"{kernel} takes gate and up of one dtype")
        out = torch.empty(tokens, n, dtype=gate.dtype)
        self._kernel(kernel, gate)(
            gate.data_ptr(),
            gate.stride(0),
            up.data_ptr(),
            up.stride(0),
            out.data_ptr(),
            n,
            tokens,
            n,
            torch.get_num_threads(),
        )
        return out

    def _kernel(self, name: str, x: torch.Tensor):
        """The float32 or bfloat16 form of an elementwise kernel, for ``x``'s dtype."""
        if x.dtype == torch.bfloat16:
            return getattr(self.lib, f"pagedllm_{name}_bf16")
        if x.dtype != torch.float32:
            raise TypeError(f"{name} takes float32 or bfloat16 tensors, not {x.dtype}")
        return getattr(self.lib, f"pagedllm_{name}")

    def sample_inverse_cdf(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """For each row of float32 ``logits`` ``[rows, vocab]`` (last dimension dense), the
        first token whose running sum of ``softmax`` reaches ``uniform`` (float32
        ``[rows]``, in (0, 1]) times the row's total: the reference's softmax, cumsum and
        searchsorted in one pass. Tokens with probability 0 (masked with -inf) are never
        chosen. Long ``[rows]``."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
            raise TypeError("sample_inverse_cdf takes float32 [rows, vocab] with dense rows")
        rows, vocab = logits.shape
        uniform = uniform.to(torch.float32).contiguous().view(-1)
        if uniform.numel() != rows:
            raise ValueError(f"{uniform.numel()} uniforms for {rows} rows")
        out = torch.empty(rows, dtype=torch.long)
        status = self.lib.pagedllm_sample_inverse_cdf(
            logits.data_ptr(),
            rows,
            vocab,
            logits.stride(0),
            uniform.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the sampling kernel could not allocate its block sums")
        return out

    def bf16_cache_ok(self, head_dim: int) -> bool:
        """Whether this build's kernel takes a bfloat16 cache for this head size."""
        return self.bf16_cache and head_dim in BF16_HEAD_DIMS

    def bf16_products(self, head_dim: int) -> bool:
        """Whether the kernel reads a bfloat16 cache of this head size with bfloat16
        products (AVX512-BF16; head sizes 32 to 256): queries rounded to bfloat16 (exact
        for a bfloat16 model's), scores summed in float32, and the softmax's probabilities
        rounded to bfloat16 where they weight the values, as torch's bfloat16 attention
        computes. Otherwise a bfloat16 cache is widened and everything is float32."""
        return self._bf16_products and self.bf16_cache_ok(head_dim) and head_dim >= 32

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_ranges: torch.Tensor,
        block_tables: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
        soft_cap: float | None = None,
    ) -> None:
        """Writes ``key``/``value`` (``[T, kv_heads*d]``) at ``slot_mapping`` into
        ``kv_cache`` (``[2, blocks, block_size, kv_heads, d]``, contiguous), then attends
        the query tokens of each sequence into ``out`` (``[T, heads*d]``). Query, key,
        value and ``out`` are float32; the cache float32, or bfloat16 where
        :meth:`bf16_cache_ok` says so (written rounded to nearest even, as ``.to()``
        rounds; read widened to float32, or with bfloat16 products where
        :meth:`bf16_products` says so).

        ``seq_ranges`` is int64 ``[3, S]``: each sequence's first and end token in the
        flat batch and its context length with this step's tokens; ``block_tables`` is
        int32 ``[S, max_blocks]``. Tokens of sequences not listed are written to the cache
        but not attended. ``soft_cap``: the scores become ``cap * tanh(score / cap)``
        before the softmax (Gemma 2)."""
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"soft_cap must be positive, not {soft_cap}")
        _, num_blocks, block_size = kv_cache.shape[:3]
        num_seqs = seq_ranges.shape[1]
        if kv_cache.dtype == torch.bfloat16:
            kernel = self.lib.pagedllm_paged_attention_bf16
        elif kv_cache.dtype == torch.float32:
            kernel = self.lib.pagedllm_paged_attention
        else:
            raise ValueError(f"the paged-attention kernel takes no {kv_cache.dtype} cache")
        status = kernel(
            query.data_ptr(),
            query.stride(0),
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            kv_cache.data_ptr(),
            num_blocks * block_size,
            block_size,
            slot_mapping.data_ptr(),
            key.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            num_seqs,
            seq_ranges[0].data_ptr(),
            seq_ranges[1].data_ptr(),
            seq_ranges[2].data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            scale,
            sliding_window or 0,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
            soft_cap or 0.0,
        )
        if status == -1 and kv_cache.dtype == torch.bfloat16:
            raise ValueError(
                f"heads of size {head_dim}: the paged-attention kernel takes a bfloat16 cache "
                f"on AVX-512 CPUs for head sizes 16, 32, 64, 128 and 256"
            )
        if status == -1:
            raise ValueError(
                f"{num_heads} heads of size {head_dim} over {num_kv_heads} KV heads: the "
                f"paged-attention kernel takes head sizes up to {MAX_HEAD_DIM} and up to "
                f"{MAX_GROUP} query heads per KV head"
            )
        if status != 0:
            raise MemoryError("the paged-attention kernel could not allocate its work list")


def cpu_ops_for(x: torch.Tensor) -> CpuOps | None:
    """The compiled kernels for ops on ``x``: None for a tensor off the CPU, and while
    ``torch.compile`` traces the model (Inductor generates fused code for those ops
    itself; a call into the library would split its graph)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return cpu_ops()


@functools.cache
def cpu_ops() -> CpuOps | None:
    """The compiled kernels, or None (after one warning) when they cannot be built."""
    lib = load_kernel_library("cpu_ops")
    return None if lib is None else CpuOps(lib)
