"""The experts of a mixture-of-experts layer, whose storage and computation a quantization
method may take over (as ``Linear``'s), and the loading of checkpoints that store them
one tensor per expert."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.linear import mark_rows, mark_shard
from pagedllm.core.layers.static import static_shapes
from pagedllm.distributed.parallel_state import all_reduce, expert_parallel, tp_rank, tp_size
from pagedllm.kernels.moe import moe_dense, moe_reference

if TYPE_CHECKING:
    from pagedllm.core.interfaces import QuantizationConfig

# An expert's tensor -> (the fused parameter it is part of, which rows of the expert's
# slice: None = all, 0 = the first half (gate), 1 = the second (up)).
_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", None)}


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs, ``down(act(gate(x)) * up(x))``, of which each token
    runs those its router chose, weighted.

    Unquantized, the weights are the parameters ``gate_up_proj`` ``[E, 2 * inter,
    hidden]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[E, hidden,
    inter]``, transformers' names and layout; checkpoints with one tensor per expert fill
    them through :meth:`load_expert`. With a quantization config, the method its
    ``get_moe_method`` returns for this layer's ``prefix`` stores and computes them.

    With several tensor-parallel ranks each holds its share of every expert's
    intermediate rows, or with ``--enable-expert-parallel`` its share of the experts
    (``num_experts`` is then the rank's, numbered from ``first_expert``); the ranks'
    outputs are summed.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        act: nn.Module,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # With tensor parallelism each rank holds every expert's share of the
        # intermediate rows (gate and up column-parallel, down row-parallel), or with
        # --enable-expert-parallel its share of the experts, whole: either way its
        # partial outputs are summed over the ranks.
        ranks, rank = tp_size(), tp_rank()
        self.full_experts, self.full_inter = num_experts, inter
        self.reduce, self.by_expert = ranks > 1, expert_parallel()
        # This rank's first expert and first intermediate row.
        self.first_expert = self.first = 0
        if self.by_expert:
            if num_experts % ranks:
                raise ConfigError(
                    f"{prefix}: its {num_experts} experts do not divide over {ranks} "
                    "tensor-parallel ranks (--enable-expert-parallel)"
                )
            num_experts //= ranks
            self.first_expert = rank * num_experts
        elif inter % ranks:
            raise ConfigError(
                f"{prefix}: the experts' intermediate size {inter} does not divide over "
                f"{ranks} tensor-parallel ranks"
            )
        else:
            inter //= ranks
            self.first = rank * inter
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.prefix = prefix
        self.act = act
        self.method = quant_config.get_moe_method(self, prefix) if quant_config else None
        if self.method is not None and self.reduce:
            raise ConfigError(
                f"{prefix}: quantized experts ({quant_config.name}) cannot be split over "
                "tensor-parallel ranks yet"
            )
        if self.method is None:
            self.gate_up_proj = nn.Parameter(
                torch.empty(num_experts, 2 * inter, hidden), requires_grad=False
            )
            self.down_proj = nn.Parameter(
                torch.empty(num_experts, hidden, inter), requires_grad=False
            )
            if self.by_expert:
                mark_shard(self.gate_up_proj, 0, self.first_expert, num_experts)
                mark_shard(self.down_proj, 0, self.first_expert, num_experts)
            elif self.reduce:
                first, full = self.first, self.full_inter
                mark_rows(self.gate_up_proj, [(first, inter), (full + first, inter)], dim=1)
                mark_shard(self.down_proj, 2, first, inter)
        else:
            self.method.create_weights(self, num_experts, hidden, inter, torch.get_default_dtype())
        # Which (parameter, expert, part) load_expert filled.
        self._filled: set[tuple[str, int, Any]] = set()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` through each token's experts ``ids`` ``[T, top_k]``,
        their outputs summed with ``weights`` ``[T, top_k]``."""
        if self.method is not None:
            return self.method.apply(self, x, weights, ids)
        if self.by_expert:
            # (this rank's experts by their local number; the others' as num_experts,
            # which the kernels skip)
            local = ids - self.first_expert
            held = (local >= 0) & (local < self.num_experts)
            ids = torch.where(held, local, self.num_experts)
            weights = torch.where(held, weights, 0)
        if static_shapes():
            out = moe_dense(x, self.gate_up_proj, self.down_proj, weights, ids, self.act)
        else:
            out = moe_reference(x, self.gate_up_proj, self.down_proj, weights, ids, self.act)
        return all_reduce(out) if self.reduce else out

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one expert's ``part`` (``gate``, ``up``: ``[inter, hidden]``; ``down``:
        ``[hidden, inter]``) into the fused parameters."""
        if self.method is not None:
            raise ConfigError(
                f"{self.prefix}: per-expert checkpoint tensors of quantized experts are not "
                "supported"
            )
        name, half = _PARTS[part]
        if not 0 <= expert < self.full_experts:
            raise ValueError(f"{self.prefix} has {self.full_experts} experts, not expert {expert}")
        if self.by_expert:  # (this rank's experts, by their local number)
            expert -= self.first_expert
            if not 0 <= expert < self.num_experts:
                return
        elif self.reduce:  # (this rank's intermediate rows: gate/up rows, down columns)
            tensor = tensor.narrow(0 if half is not None else 1, self.first, self.inter)
        target = getattr(self, name)[expert]
        if half is not None:
            target = target[half * self.inter : (half + 1) * self.inter]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{self.prefix}.{expert}.{part}: shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        self._filled.add((name, expert, half))

    def filled_by_experts(self) -> set[str]:
        """The parameters (local names) every expert's parts have filled."""
        needed = {"gate_up_proj": (0, 1), "down_proj": (None,)}
        return {
            name
            for name, halves in needed.items()
            if all(
                (name, expert, half) in self._filled
                for expert in range(self.num_experts)
                for half in halves
            )
        }

    def extra_repr(self) -> str:
        held = f"{self.first_expert}..{self.first_expert + self.num_experts - 1} of "
        experts = f"{held if self.by_expert else ''}{self.full_experts}"
        return f"experts={experts}, hidden={self.hidden}, inter={self.inter}"
