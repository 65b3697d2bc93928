"""The batched LoRA product: each token's ``x @ A[s].T @ B[s].T * scale[s]`` with ``s`` its
request's adapter slot (-1: none), added to the base layer's output.

:func:`lora_delta_reference` gathers every token's own matrices (the definition);
:func:`add_lora` groups the step's tokens by slot and runs one pair of GEMMs per adapter
(a step's tokens of one request are contiguous, and a batch holds few adapters), which is
what the engine calls. When the adapters have few tokens each (decode steps), a float32
CPU step goes to the C kernel ``csrc/lora_cpu.c`` (one token at a time, its rank-``r``
intermediate in registers), which saves the per-adapter GEMM calls."""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from pagedllm.kernels.native import load_kernel_library

# Tokens per adapter up to which the C kernel is used.
BGMV_MAX_TOKENS_PER_ADAPTER = 8


@functools.cache
def _bgmv() -> ctypes.CDLL | None:
    lib = load_kernel_library("lora_cpu")
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.pagedllm_lora_bgmv.argtypes = [
            ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int
        ]  # fmt: skip
        lib.pagedllm_lora_bgmv.restype = ctypes.c_int
    return lib


def lora_bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
) -> bool:
    """``y += lora_delta_reference(...)`` by the C kernel, in place; False (nothing done)
    where it does not apply (no kernel, not float32 on the cpu, a view of ``y``)."""
    lib = _bgmv()
    tensors = (y, x, a, b, scale)
    usable = (
        lib is not None
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and all(t.is_contiguous() for t in (*tensors, slots))
        and slots.dtype == torch.long
    )
    if not usable:
        return False
    tokens, size_in = x.shape
    status = lib.pagedllm_lora_bgmv(
        x.data_ptr(), slots.data_ptr(), tokens, size_in, y.shape[1], a.shape[1],
        a.data_ptr(), b.data_ptr(), scale.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return status == 0


def lora_delta_reference(
    x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``[tokens, out]``: token ``t``'s delta ``x[t] @ a[s].T @ b[s].T * scale[s]`` for
    ``s = slots[t]`` (zeros where ``s < 0``); ``a`` ``[slots, r, in]``, ``b``
    ``[slots, out, r]``."""
    used = slots.clamp(min=0)
    low = torch.bmm(a[used], x.unsqueeze(-1))  # [T, r, 1]
    delta = torch.bmm(b[used], low).squeeze(-1) * scale[used].unsqueeze(-1)
    return torch.where((slots >= 0).unsqueeze(-1), delta, torch.zeros_like(delta))


@dataclasses.dataclass(frozen=True, slots=True)
class LoRABatch:
    """The adapters of the rows a layer sees: each row's slot (-1: none), and each active
    slot with its rows. Built once per step (and per selection of rows), not per layer."""

    slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]

    @classmethod
    def from_slots(cls, slots: torch.Tensor) -> LoRABatch:
        groups = [
            (slot, (slots == slot).nonzero().flatten())
            for slot in slots.unique().tolist()
            if slot >= 0
        ]
        return cls(slots, groups)

    @property
    def few_tokens(self) -> bool:
        """Whether every adapter has few rows (decode steps: the C kernel's case)."""
        return max(len(rows) for _, rows in self.groups) <= BGMV_MAX_TOKENS_PER_ADAPTER


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """``y`` plus the LoRA deltas of ``batch``'s rows (its ``groups``: each active slot
    with the rows of its tokens). Weights kept in another dtype (``--lora-dtype``) are
    computed with in the activations' dtype."""
    if batch.few_tokens and lora_bgmv(y, x, batch.slots, a, b, scale):
        return y
    for slot, rows in batch.groups:
        low = x.index_select(0, rows) @ a[slot].T.to(x.dtype)
        y.index_add_(0, rows, (low @ b[slot].T.to(x.dtype)) * scale[slot])
    return y


def add_lora_embedding(
    y: torch.Tensor,
    ids: torch.Tensor,
    batch: LoRABatch,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """An embedding's LoRA (peft's ``lora_embedding_A`` ``[r, vocab]`` and ``_B``
    ``[dim, r]`` per slot): each token's row of ``A.T`` through ``B``, added to ``y``."""
    for slot, rows in batch.groups:
        low = a[slot].T.index_select(0, ids.index_select(0, rows)).to(y.dtype)
        y.index_add_(0, rows, (low @ b[slot].T.to(y.dtype)) * scale[slot])
    return y
