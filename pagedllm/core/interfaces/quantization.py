"""The quantization extension point (``--quantization``): a config and per-layer methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class LinearMethod(ABC):
    """How one linear layer stores its weights and computes ``x @ W.T + b``.

    Contract: :meth:`create_weights` registers parameters on ``layer`` (their names are
    what the loader fills); :meth:`process_weights_after_loading` may repack them once;
    :meth:`apply` must be numerically a linear map of ``x``; :meth:`fuse` says whether
    layers that read the same input (Q/K/V, gate/up) can be computed as one.
    """

    # Whether :meth:`apply` (and the module :meth:`fuse` returns) computes each row the
    # same way whatever rows share the call while ``pagedllm.kernels.batch_invariant``'s
    # mode is on (``--batch-invariant`` refuses layers of methods that do not).
    batch_invariant: ClassVar[bool] = False

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        """Register this method's parameters on ``layer``."""

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute the layer's output for activations ``x``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:  # noqa: B027
        """Repack loaded weights (optional)."""

    def fuse(self, layers: Sequence[torch.nn.Module]) -> torch.nn.Module | None:
        """One module computing ``layers`` together, or ``None`` (the default) when this
        method cannot fuse them: they are then computed one by one.

        ``layers`` are consecutive layers of a group that read the same input, each built
        with a method of this class, before any weight is loaded (the model builds its
        groups at construction). The module's ``forward(x)`` returns the list of their
        outputs, in order; typically it is one product whose output dims are theirs
        concatenated, split. The layers' parameters must become views of the tensors it
        computes with (row slices of a fused weight), because the loader then fills the
        layers by their checkpoint names; it keeps those tensors as non-persistent
        buffers. A method whose :meth:`process_weights_after_loading` replaces parameters
        must not fuse.
        """
        return None

    def shard_narrow(self, dim: int, start: int, length: int) -> tuple[int, int, int] | None:
        """Tensor parallelism: where the values ``[start, start + length)`` along ``dim``
        of the full weight (0: output rows, 1: input columns) lie in this method's stored
        ``weight``, as ``(dim, start, length)`` of the stored tensor, or ``None`` (the
        default) when its layout cannot be split there: the layer is then refused by name.
        """
        return None


class EmbeddingMethod(LinearMethod):
    """How a vocabulary embedding stores its table: rows are looked up by token id, and
    :meth:`apply` is the product with the table, so a tied head reuses it.

    :meth:`create_weights` receives ``input_size`` = embedding width and ``output_size`` =
    vocabulary size.
    """

    @abstractmethod
    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the table, as floats of the engine dtype."""


class MoEMethod(ABC):
    """How a mixture-of-experts layer (``pagedllm.core.layers.moe.FusedMoE``) stores its
    experts' weights and computes them.

    Contract: :meth:`create_weights` registers parameters on ``layer`` for
    ``num_experts`` gated MLPs of ``hidden`` -> ``inter`` -> ``hidden`` (their names are
    what the loader fills); :meth:`apply` returns, for activations ``x`` ``[T, hidden]``,
    the sum over each token's experts ``ids`` ``[T, top_k]`` of ``weights`` ``[T,
    top_k]`` times the expert's output (``pagedllm.kernels.moe.moe_reference`` computes
    it for float weights).
    """

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden: int, inter: int, params_dtype: Any
    ) -> None:
        """Register this method's parameters on ``layer``."""

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted outputs for ``x``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:  # noqa: B027
        """Repack loaded weights (optional)."""


class QuantizationConfig(ABC):
    """A quantization method's settings, read from the checkpoint or the command line.

    Contract: :meth:`from_config` accepts the model's ``quantization_config`` dict (empty
    when the user chose the method with ``--quantization`` alone) and raises
    ``ValueError`` naming what it cannot handle; :meth:`get_linear_method` returns the
    method for one layer, or ``None`` to leave that layer unquantized.
    """

    name: ClassVar[str]
    # Other checkpoint ``quant_method`` values this method reads (an alias such as vLLM's
    # ``gptq_marlin`` for ``gptq`` checkpoints); its own name always.
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    # The load format that reads this method's checkpoints, where the default ones
    # cannot (``--load-format auto`` then picks it; another explicit format is refused).
    load_format: ClassVar[str | None] = None

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from a ``quantization_config`` dict."""

    @abstractmethod
    def get_linear_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.0.mlp``)."""

    def get_embedding_method(self, layer: torch.nn.Module, prefix: str) -> EmbeddingMethod | None:
        """The method for the vocabulary embedding at ``prefix``, or ``None`` (default)
        to keep it in floats."""
        return None

    def get_moe_method(self, layer: torch.nn.Module, prefix: str) -> MoEMethod | None:
        """The method for the mixture-of-experts layer at ``prefix`` (its experts'
        weights), or ``None`` to keep them in floats. The default refuses: a method
        quantizes experts only where it says how."""
        from pagedllm.core.errors import ConfigError

        raise ConfigError(
            f"--quantization {self.name} does not quantize mixture-of-experts layers "
            f"({prefix}); run this model unquantized"
        )

    def supported_dtypes(self) -> tuple[str, ...]:
        """Activation dtypes this method works with."""
        return ("float32", "float16", "bfloat16")
