"""Linear layers whose storage and matmul a quantization method may take over, and groups
of them reading the same input (Q/K/V, gate/up) computed with as few products as their
methods allow.

With tensor parallelism (:mod:`pagedllm.distributed.parallel_state`) a layer built with
``parallel="column"`` holds a slice of the output rows and ``parallel="row"`` a slice of
the input columns, Megatron style: a column layer feeding a row layer needs one
all-reduce, after the row layer's product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.parallel_state import all_reduce, shard_range, tp_rank, tp_size
from pagedllm.kernels.batch_invariant import linear

if TYPE_CHECKING:
    from pagedllm.core.interfaces import QuantizationConfig

PARALLEL_STYLES = ("column", "row")


def mark_rows(param: nn.Parameter, ranges: Sequence[tuple[int, int]], dim: int = 0) -> None:
    """Record that ``param`` holds the full tensor's rows ``[start, start + length)`` (along
    ``dim``) of each of ``ranges``, concatenated: a rank's share of each part of a fused
    weight (Q, K and V stacked in one ``qkv_proj``, say). ``copy_weights`` gathers them."""
    param.tp_rows = tuple(ranges)
    param.tp_rows_dim = dim


def fused_rows(layer: Linear, parts: Sequence[tuple[int, int]], full: int) -> None:
    """With several tensor-parallel ranks, ``layer`` (built with this rank's output size,
    not split by ``parallel``) holds this rank's rows of each part of a fused weight (Q,
    K and V stacked in one projection, say) of ``full`` rows: ``parts`` are ``(start,
    length)`` of the full checkpoint tensor's output rows. Its bias holds the same rows;
    a quantized weight the same rows of its method's stored layout
    (``LinearMethod.shard_narrow``), or the layer is refused by name."""
    layer.full_output_size = full
    if tp_size() == 1:
        return
    ranges, dim = list(parts), 0
    if layer.method is not None:
        placed = [layer.method.shard_narrow(0, start, length) for start, length in parts]
        if any(p is None for p in placed) or len({p[0] for p in placed}) != 1:
            raise ConfigError(
                f"{type(layer.method).__name__}: layer {layer.prefix!r} cannot be split over "
                f"{tp_size()} tensor-parallel ranks in its stored layout"
            )
        dim, ranges = placed[0][0], [(start, length) for _, start, length in placed]
    mark_rows(layer.weight, ranges, dim)
    if layer.bias is not None:
        mark_rows(layer.bias, parts)


def mark_shard(param: nn.Parameter, dim: int, start: int, length: int, pad: bool = False) -> None:
    """Record that ``param`` holds ``length`` entries from ``start`` along ``dim`` of the
    checkpoint's full tensor: ``copy_weights`` narrows the full tensor to them. ``pad``:
    the range may run past the tensor (a vocabulary padded to a multiple of the ranks),
    the rest zeros; elsewhere a tensor too short for the range is refused."""
    param.tp_narrow = (dim, start, length)
    param.tp_pad = pad


def narrow_shard(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Entries ``[start, start + length)`` along ``dim`` of a full checkpoint tensor (a
    view where it can be), zero-padded where the range runs past the tensor (the padding
    rows of a vocabulary split over the ranks)."""
    size = tensor.shape[dim]
    if start + length <= size:
        return tensor.narrow(dim, start, length)
    start = min(start, size)
    part = tensor.narrow(dim, start, size - start)
    padding = list(tensor.shape)
    padding[dim] = length - part.shape[dim]
    return torch.cat([part, tensor.new_zeros(padding)], dim=dim)


def rank_share(
    param: nn.Parameter, tensor: torch.Tensor, name: str, dims: Sequence[int] = (0, 1, 2)
) -> torch.Tensor:
    """This rank's part of ``tensor``, a full tensor laid out as ``param``'s checkpoint
    tensor: its rows of each part of a fused weight (``tp_rows``, :func:`mark_rows`),
    then its entries along ``tp_narrow`` (:func:`mark_shard`; zero-padded only where
    ``tp_pad``); only the marks along ``dims``. A tensor too small for them is a
    ``ConfigError`` naming it (``name``)."""
    rows = getattr(param, "tp_rows", None)
    dim = getattr(param, "tp_rows_dim", 0)
    if rows is not None and dim in dims and sum(length for _, length in rows) != tensor.shape[dim]:
        if max(start + length for start, length in rows) > tensor.shape[dim]:
            raise ConfigError(
                f"weight {name!r} has shape {tuple(tensor.shape)}: too few rows for this "
                f"tensor-parallel rank's parts {list(rows)}"
            )
        parts = [tensor.narrow(dim, start, length) for start, length in rows]
        tensor = torch.cat(parts, dim=dim)
    narrow = getattr(param, "tp_narrow", None)
    if narrow is not None and narrow[0] in dims and tensor.dim() > narrow[0]:
        dim, start, length = narrow
        if start + length > tensor.shape[dim] and not getattr(param, "tp_pad", False):
            raise ConfigError(
                f"weight {name!r} has shape {tuple(tensor.shape)}: too small for this "
                f"tensor-parallel rank's entries {start}..{start + length} along dim {dim}"
            )
        tensor = narrow_shard(tensor, *narrow)
    return tensor


class Linear(nn.Module):
    """``y = x @ W.T + b``. With a quantization config, the method it returns for this
    layer's ``prefix`` creates the parameters and computes the product.

    ``input_size`` and ``output_size`` are the full layer's. With more than one
    tensor-parallel rank (read when the layer is built; with one, ``parallel`` and
    ``shard`` change nothing):

    - ``parallel="column"``: this rank holds output rows ``[start, start + length)`` of
      the full weight (and bias), ``shard = (start, length)``, by default its equal share
      :func:`~pagedllm.distributed.parallel_state.shard_range`; a shard may be held by
      several ranks (KV heads replicated over more ranks than there are heads). The
      output is this rank's slice of the full output; ``output_size`` is ``length``.
    - ``parallel="row"``: this rank holds its equal share of the input columns and takes
      the matching slice of the input; the output is the full one, the ranks' partial
      products summed (all-reduce) before the full bias is added once. ``input_size`` is
      the share.

    Sharded parameters carry ``tp_narrow`` (:func:`mark_shard`), so the checkpoint's full
    tensors load into them. A quantized layer splits where its method's stored layout
    allows (``LinearMethod.shard_narrow``: GGUF rows anywhere, columns at whole blocks);
    otherwise it is a ``ConfigError`` naming the method and the layer.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        parallel: str | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        # The full layer's sizes (a LoRA adapter's A and B are the full layer's).
        self.full_input_size, self.full_output_size = input_size, output_size
        if parallel not in (None, *PARALLEL_STYLES):
            raise ValueError(f"parallel must be one of {PARALLEL_STYLES} or None, not {parallel!r}")
        if shard is not None and parallel != "column":
            raise ValueError("an explicit shard is for column-parallel layers")
        narrow = None  # (dim, start, length) of the full weight this rank holds
        if parallel is not None and tp_size() > 1:
            if parallel == "column":
                start, length = shard_range(output_size) if shard is None else shard
                if start < 0 or length <= 0 or start + length > output_size:
                    raise ValueError(f"shard {shard} is not within {output_size} output rows")
                narrow, output_size = (0, start, length), length
            else:
                start, length = shard_range(input_size)
                narrow, input_size = (1, start, length), length
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.method = quant_config.get_linear_method(self, prefix) if quant_config else None
        weight_narrow = narrow
        if self.method is not None and narrow is not None:
            # (where the shard lies in the method's stored layout)
            weight_narrow = self.method.shard_narrow(*narrow)
            if weight_narrow is None:
                raise ConfigError(
                    f"--quantization {quant_config.name}: layer {prefix!r} cannot be split "
                    f"over {tp_size()} tensor-parallel ranks in its stored layout"
                )
        dtype = torch.get_default_dtype()
        if self.method is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        else:
            self.method.create_weights(self, input_size, output_size, dtype)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None
        if narrow is not None:
            mark_shard(self.weight, *weight_narrow)
            if narrow[0] == 0 and self.bias is not None:
                mark_shard(self.bias, *narrow)
            if narrow[0] == 1:
                # (Bound here, so that one rank's forward is the plain one, unchanged.)
                self.reduce_output = True
                self.forward = self._row_parallel_forward

    # With --enable-lora: this layer's adapter slots and the manager that knows the step's
    # tokens of each adapter (pagedllm.lora.manager).
    lora: Any = None
    lora_manager: Any = None
    # Whether this rank's product is a partial sum the ranks add up: a row-parallel layer
    # on several ranks, whose forward is then _row_parallel_forward (set when built).
    reduce_output: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            y = linear(x, self.weight, self.bias)
        else:
            y = self.method.apply(self, x, self.bias)
        return self.add_lora(y, x)

    def _row_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a row-parallel layer on several ranks: the ranks' partial
        products (each with its LoRA deltas, from its columns of the adapters' A)
        summed, plus the full bias (added once)."""
        if self.method is None:
            y = linear(x, self.weight)
        else:
            y = self.method.apply(self, x, None)
        y = all_reduce(self.add_lora(y, x))
        if self.bias is not None:
            y += self.bias
        return y

    def add_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` plus the step's LoRA deltas of this layer (none without adapters)."""
        if self.lora is None or self.lora_manager.batch is None:
            return y
        return self.lora.add(y, x, self.lora_manager.batch)

    def extra_repr(self) -> str:
        text = f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
        narrow = getattr(self.weight, "tp_narrow", None) if self.method is None else None
        if narrow is not None:
            style = "row" if narrow[0] else "column"
            text += f", {style} shard {narrow[1:]} of rank {tp_rank()}"
        return text


def share_rows(
    layers: Sequence[nn.Module], sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and one bias, zeros for a layer without one) of ``sum(sizes)`` rows,
    like the layers' weights, whose row slices become the layers' own ``weight`` (and
    ``bias``), in order: loading the layers by name then fills the fused tensors."""
    first = layers[0].weight
    weight = first.new_empty((sum(sizes), *first.shape[1:]))
    biases = [layer.bias for layer in layers if layer.bias is not None]
    bias = biases[0].new_zeros(sum(sizes)) if biases else None
    offset = 0
    for layer, size in zip(layers, sizes, strict=True):
        layer.weight.data = weight[offset : offset + size]
        if layer.bias is not None:
            layer.bias.data = bias[offset : offset + size]
        offset += size
    return weight, bias


def restack_rows(layers: Sequence[nn.Module], sizes: Sequence[int], name: str) -> torch.Tensor:
    """For fused layers whose ``name`` tensors were replaced after loading (repacked or
    quantized, each its own tensor): those tensors stacked into one, whose row slices
    become the layers' ``name`` again, so that one copy is kept."""
    stacked = torch.cat([getattr(layer, name).data for layer in layers])
    offset = 0
    for layer, size in zip(layers, sizes, strict=True):
        rows = stacked[offset : offset + size]
        if isinstance(getattr(layer, name), nn.Parameter):
            rows = nn.Parameter(rows, requires_grad=False)
        setattr(layer, name, rows)
        offset += size
    return stacked


class LinearGroup(nn.Module):
    """Linear layers that read the same input, computed as one: ``forward(x)`` returns
    their outputs, in order.

    Built with the model, before any weight is loaded. Each run of consecutive layers
    that can be fused (all unquantized, or a quantization method's ``fuse`` accepts
    them) is one product over a fused weight whose row slices *are* the layers'
    parameters, so loading the layers by their checkpoint names fills it and nothing is
    stored twice; a layer that fuses with no neighbour is computed on its own. The layers
    stay registered where the model put them (their names are the checkpoint's): the
    group holds only the fused tensors, as non-persistent buffers.
    """

    def __init__(self, layers: Sequence[Linear]) -> None:
        super().__init__()
        assert layers and len({layer.input_size for layer in layers}) == 1
        runs: list[nn.Module] = []
        # Whether each layer's output comes from a fused product (which bypasses its
        # Linear.forward, so LoRA deltas are added here).
        self._in_fused: list[bool] = []
        start = 0
        while start < len(layers):
            # The longest run from ``start`` that fuses; a single layer always "fuses".
            for end in range(len(layers), start, -1):
                run = _fuse(layers[start:end])
                if run is not None:
                    break
            runs.append(run)
            self._in_fused.extend([not isinstance(run, _Single)] * (end - start))
            start = end
        self.runs = nn.ModuleList(runs)
        # (a tuple: the layers are registered where the model put them)
        self.layers = tuple(layers)
        # The usual case, one fused product, called without the loop (every step, twice
        # per decoder layer).
        self._forward_one = runs[0].forward if len(runs) == 1 else None

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self._forward_one is not None:
            outs = self._forward_one(x)
        else:
            outs = [out for run in self.runs for out in run(x)]
        if self.layers[0].lora is not None:
            outs = [
                layer.add_lora(out, x) if fused else out
                for layer, out, fused in zip(self.layers, outs, self._in_fused, strict=True)
            ]
        return outs


def _fuse(layers: Sequence[Linear]) -> nn.Module | None:
    """``layers`` computed as one module returning their outputs, or None."""
    if len(layers) == 1:
        return _Single(layers[0])
    methods = [layer.method for layer in layers]
    if all(method is None for method in methods):
        return FusedLinear(layers)
    first = methods[0]
    if first is None or any(type(method) is not type(first) for method in methods):
        return None
    return first.fuse(layers)


class _Single(nn.Module):
    """One layer of a group, computed on its own."""

    def __init__(self, layer: Linear) -> None:
        super().__init__()
        # A tuple, so the layer is not registered twice (it is named where it lives).
        self.layer = (layer,)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.layer[0](x)]

    def extra_repr(self) -> str:
        return self.layer[0].prefix


class FusedLinear(nn.Module):
    """Unquantized layers reading the same input as one GEMM (fewer, larger matmuls are
    much faster on CPUs). Their parameters become row slices of the fused weight and
    bias (zeros for a layer without one)."""

    def __init__(self, layers: Sequence[Linear]) -> None:
        super().__init__()
        self.sizes = [layer.output_size for layer in layers]
        weight, bias = share_rows(layers, self.sizes)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(linear(x, self.weight, self.bias).split(self.sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"
