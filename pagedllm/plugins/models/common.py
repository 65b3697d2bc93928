"""Pieces shared by the model implementations: norms, activations, weight loading."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.attention.layer import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelArchitecture, QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding, padded_vocab_size
from pagedllm.core.layers.linear import Linear
from pagedllm.core.layers.weights import HeldElsewhere, copy_weights, held_elsewhere
from pagedllm.distributed.parallel_state import (
    all_gather,
    pipeline_parallel,
    stage_layers,
    tp_rank,
    tp_size,
)
from pagedllm.kernels import triton_rows
from pagedllm.kernels.batch_invariant import linear
from pagedllm.kernels.cpu_ops import cpu_ops_for
from pagedllm.kernels.norms import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm; float32 and bfloat16 CPU rows go to the compiled kernel
    (:mod:`pagedllm.kernels.cpu_ops`), GPU rows to the Triton one."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_for(x)
        if ops is not None and ops.rows_ok(x) and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps, self.offset)
        if self.weight.dtype == x.dtype and triton_rows(x):
            # (Imported here: triton costs a CPU server 70 MB and 70 ms at start-up.)
            from pagedllm.kernels.triton_attention import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm(x, self.weight, self.eps, self.offset)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, self(residual + x))``, in one pass where the kernel runs."""
        ops = cpu_ops_for(x)
        if (
            ops is not None
            and ops.rows_ok(x)
            and residual.is_contiguous()
            and residual.dtype == x.dtype
            and residual.shape == x.shape
            and self.weight.dtype == x.dtype
        ):
            return ops.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        if (
            triton_rows(x)
            and triton_rows(residual)
            and residual.dtype == x.dtype
            and residual.shape == x.shape
            and self.weight.dtype == x.dtype
        ):
            from pagedllm.kernels.triton_attention import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps, self.offset, residual=residual)
        total = residual + x
        return total, self(total)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with frozen parameters and :meth:`add_forward`, so that decoder
    layers written for :class:`RMSNorm` take it too."""

    def __init__(self, size: int, eps: float, bias: bool = True) -> None:
        super().__init__(size, eps=eps, bias=bias)
        self.requires_grad_(False)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, self(residual + x))``."""
        total = residual + x
        return total, self(total)


# The common activations, computed as transformers' ACT2FN computes them (the same
# torch functions), without importing transformers.activations, which pulls in
# torch._dynamo and hub kernels at start-up. tests/plugins/models/test_parity.py checks the table.
_ACTIVATIONS: dict[str, Any] = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


def activation(name: str) -> nn.Module:
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ConfigError(f"activation {name!r} is not supported")
    return ACT2FN[name]


class TwoLayerMLP(nn.Module):
    """``proj(act(fc(x)))``: the MLP of GPT-2-style blocks. The two layers are registered
    under their checkpoint names, ``names`` (a subclass per model sets them)."""

    names: ClassVar[tuple[str, str]] = ("fc1", "fc2")

    def __init__(
        self,
        hidden: int,
        inner: int,
        bias: bool,
        act: str,
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        fc_name, proj_name = self.names
        # (Megatron-style over tensor-parallel ranks: one all-reduce, after proj.)
        fc = Linear(hidden, inner, bias, quant, f"{prefix}.{fc_name}", parallel="column")
        proj = Linear(inner, hidden, bias, quant, f"{prefix}.{proj_name}", parallel="row")
        setattr(self, fc_name, fc)
        setattr(self, proj_name, proj)
        # (A tuple: the layers are registered once, under their names above.)
        self.layers = (fc, proj)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, proj = self.layers
        return proj(self.act(fc(x)))


def held_part(make: Any, held: bool) -> nn.Module:
    """``make()`` where this rank holds the part, else a :class:`HeldElsewhere`."""
    return make() if held else HeldElsewhere()


def decoder_layers(num_layers: int, make: Any) -> tuple[nn.ModuleList, tuple[nn.Module, ...]]:
    """The decoder's layers, ``make(i)`` for those this pipeline stage holds (every one
    without pipeline parallelism) and placeholders for the others, and the held ones in
    order (what the stage runs)."""
    held = stage_layers(num_layers)
    layers = nn.ModuleList(held_part(lambda i=i: make(i), i in held) for i in range(num_layers))
    return layers, tuple(layers[i] for i in held)


class DecoderStack(nn.Module):
    """A decoder: an embedding, layers and a final part (norm, projection), of which a
    pipeline stage holds its share: stage 0 the embedding, each stage its layers
    (:func:`decoder_layers`), the last stage the final part; the others are
    :class:`HeldElsewhere`. A subclass builds its parts with :meth:`init_stage`,
    :func:`held_part` and :func:`decoder_layers` (setting ``stage_layers``), and says
    how to :meth:`embed`, :meth:`run_layer` and :meth:`finish`."""

    stage_layers: tuple[nn.Module, ...]
    last_stage: bool = True

    def init_stage(self) -> Any:
        """This process's pipeline stage (``first``, ``last``), recorded."""
        stage = pipeline_parallel()
        self.last_stage = stage.last
        return stage

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_layer(
        self, layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's output: the final hidden states on the last stage (every one
        without pipeline parallelism), else its layers' output for the next stage.
        ``intermediate``: the previous stage's output, in place of the token ids."""
        hidden = self.embed(input_ids, positions) if intermediate is None else intermediate
        for layer in self.stage_layers:
            hidden = self.run_layer(layer, positions, hidden, metadata)
        return self.finish(hidden) if self.last_stage else hidden


# Checkpoint names of an fp8 KV cache's scales, by the module that computes the
# attention: ``<attn>.k_scale`` (AutoFP8, llm-compressor) and the older
# ``<attn>.k_proj.output_scale``; likewise for values.
_KV_SCALE_SUFFIXES = {
    ".k_scale": "k",
    ".v_scale": "v",
    ".k_proj.output_scale": "k",
    ".v_proj.output_scale": "v",
}


def take_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Any = None
) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` without the KV-cache scales a checkpoint quantized for an fp8 cache
    carries; each is kept on its layer's ``Attention`` as ``checkpoint_k_scale`` /
    ``checkpoint_v_scale``, which the engine uses with ``--kv-cache-dtype fp8``."""
    for name, tensor in weights:
        suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        target = rename(name) if rename else name
        if target is None or held_elsewhere(model, target):
            continue  # (the model drops it, as copy_weights does)
        try:
            owner = model.get_submodule(target[: -len(suffix)])
        except AttributeError:
            owner = None
        layers = [m for m in owner.modules() if isinstance(m, Attention)] if owner else []
        if len(layers) != 1 or tensor.numel() != 1:
            raise ConfigError(f"the checkpoint has a KV-cache scale {name!r} for no attention")
        setattr(layers[0], f"checkpoint_{_KV_SCALE_SUFFIXES[suffix]}_scale", float(tensor))


def layer_sliding_windows(config: Any, disable_sliding_window: bool = False) -> list[int | None]:
    """The sliding window of each layer (None = full attention)."""
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if disable_sliding_window or not window:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [window] * num_layers


def kv_head_share(num_kv_heads: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads this tensor-parallel rank holds: its equal share
    when there are at least as many heads as ranks, else one head, ``rank // (ranks //
    num_kv_heads)``, replicated over the ranks whose query heads share it. ``count`` is
    the number of KV heads a rank's KV cache holds."""
    size, rank = tp_size(), tp_rank()
    if num_kv_heads >= size:
        share = num_kv_heads // size
        return rank * share, share
    return rank // (size // num_kv_heads), 1


class CausalLM(nn.Module, ModelArchitecture):
    """A decoder and a vocabulary head, tied to the input embedding or not.

    Subclasses build their decoder, then call :meth:`init_head`; they adapt checkpoint
    names in :meth:`checkpoint_name` and tensors in :meth:`prepare_weights`.
    """

    # Its decoder (a DecoderStack) is split over pipeline stages.
    supports_pipeline_parallel = True
    # The attribute holding the decoder (a DecoderStack, or a module whose forward takes
    # the same arguments).
    decoder_attr: ClassVar[str] = "model"
    # Whether the head is tied when the config does not say.
    tie_by_default: bool = False
    # Whether an untied head has a bias (Phi's has).
    head_bias: ClassVar[bool] = False
    # Whether the head is a Linear split by vocabulary rows over the tensor-parallel
    # ranks, whose logits compute_logits gathers (set by init_head).
    gather_head_logits: bool = False
    # The config's sizes of the layers split by rows over the tensor-parallel ranks
    # (each must divide by their number).
    split_sizes: ClassVar[tuple[str, ...]] = ("intermediate_size",)
    # A mixture of experts': the config's number of experts and their intermediate size
    # (one of split_sizes, but not split with --enable-expert-parallel: the experts are).
    expert_count: ClassVar[str | None] = None
    expert_size: ClassVar[str | None] = None

    @classmethod
    def check_tensor_parallel(cls, config: Any, size: int, *, experts: bool = False) -> None:
        """As ``ModelArchitecture``'s, and the attention heads, the KV heads (or ``size``
        by them, when there are fewer) and the ``split_sizes`` divide evenly (with
        ``experts``, the number of experts rather than their intermediate size)."""
        super().check_tensor_parallel(config, size)
        if size == 1:
            return
        split_sizes = cls.split_sizes
        if experts and cls.expert_count is not None:
            kept = [field for field in split_sizes if field != cls.expert_size]
            split_sizes = (cls.expert_count, *kept)
        name = cls.__name__
        heads, kv_heads = config.num_attention_heads, cls.num_kv_heads(config)
        problems = []
        if heads % size:
            problems.append(f"its {heads} attention heads do not divide by {size}")
        if kv_heads >= size and kv_heads % size:
            problems.append(f"its {kv_heads} KV heads do not divide by {size}")
        if kv_heads < size and size % kv_heads:
            problems.append(f"{size} is not a multiple of its {kv_heads} KV heads")
        for field in split_sizes:
            value = getattr(config, field, None)
            if value and value % size:
                problems.append(f"its {field.replace('_', ' ')} {value} does not divide by {size}")
        if problems:
            raise ConfigError(
                f"{name} cannot be split over --tensor-parallel-size {size}: " + "; ".join(problems)
            )

    @classmethod
    def num_kv_heads(cls, config: Any) -> int:
        """The number of KV heads a model of Hugging Face ``config`` has."""
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def init_head(
        self,
        config: Any,
        embedding: nn.Embedding | VocabEmbedding,
        input_size: int,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        """The vocabulary head: the input embedding when tied, else a ``Linear`` that
        ``quant_config`` may quantize (prefix ``lm_head``). With several tensor-parallel
        ranks the untied head is split by vocabulary rows (padded to a multiple of the
        ranks), and :meth:`compute_logits` gathers the full logits."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", self.tie_by_default))
        # (the width of the final hidden states, which the last pipeline stage sends)
        self.head_input_size = input_size
        if not pipeline_parallel().first:
            self.lm_head = HeldElsewhere()  # (stage 0 computes the logits)
            return
        if self.tie_word_embeddings:
            if self.head_bias:
                raise ConfigError(
                    f"{type(self).__name__} with tie_word_embeddings (a head with a bias "
                    "tied to the embedding) is not supported"
                )
            self.lm_head = embedding
        else:
            self.vocab_size = config.vocab_size
            self.lm_head = Linear(
                input_size,
                padded_vocab_size(config.vocab_size),
                self.head_bias,
                quant_config,
                "lm_head",
                parallel="column",
            )
            self.lm_head.full_output_size = config.vocab_size  # (an adapter's B rows)
            self.gather_head_logits = tp_size() > 1
            for param in (self.lm_head.weight, self.lm_head.bias):
                if param is not None and hasattr(param, "tp_narrow"):
                    param.tp_pad = True  # (the vocabulary's padding rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoder = getattr(self, self.decoder_attr)
        return decoder(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if isinstance(head, VocabEmbedding):
            return head.as_linear(hidden_states).float()
        if self.gather_head_logits:
            logits = all_gather(head(hidden_states), dim=-1)
            return logits[..., : self.vocab_size].float().contiguous()
        if isinstance(head, Linear):
            return head(hidden_states).float()
        return linear(hidden_states, head.weight).float()

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (None drops the tensor)."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # the embedding is the head
        return name

    def prepare_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint tensors in the layout of this model's parameters."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = take_kv_scales(self, self.prepare_weights(weights), self.checkpoint_name)
        return copy_weights(self, weights, rename=self.checkpoint_name)


# The dtypes a float module's weights come in.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def renamed(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """``name`` with the first of ``renames``' ``(old prefix, new prefix)`` it starts with
    applied."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class VisionLanguageWeights:
    """Mixin of the vision-language models (listed before their decoder's class): the
    checkpoint's prefixes renamed to the model's (``checkpoint_renames``), and the vision
    parts (``vision_prefixes``), which run as float modules whatever ``quantization`` (the
    text model's method, set by the model) is, refused by name where the checkpoint
    quantized them."""

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    quantization: str | None = None

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name, self.checkpoint_renames))  # type: ignore[misc]

    def prepare_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return float_part_weights(
            self,
            super().prepare_weights(weights),  # type: ignore[misc]
            self.vision_prefixes,
            "vision tower",
            self.quantization,
        )


def float_part_weights(
    model: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    prefixes: tuple[str, ...],
    part: str,
    quantization: str | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, refusing by name a tensor of ``part`` (``model``'s parameters under
    ``prefixes``, which no quantization method applies to: a vision tower run as a float
    module) in a quantized layout: a name the float module lacks (``qweight``,
    ``weight_scale``) or a dtype that is not a float's. ``quantization``: the model's
    method (None: nothing is checked)."""
    params: set[str] | None = None
    for name, tensor in weights:
        target = model.checkpoint_name(name) if quantization is not None else None
        if target is not None and target.startswith(prefixes):
            if params is None:
                params = {n for n, _ in model.named_parameters()}
            if target not in params or tensor.dtype not in _FLOAT_DTYPES:
                raise ConfigError(
                    f"--quantization {quantization}: the checkpoint's {part} is quantized "
                    f"({name!r}, {str(tensor.dtype).removeprefix('torch.')}); pagedllm runs "
                    f"the {part} of {type(model).__name__} in floats (as vLLM does for "
                    f"gptq checkpoints, which leave it so) and quantizes the language "
                    f"model only: use a checkpoint whose quantization leaves the {part} "
                    f"out (modules_to_not_convert, ignore)"
                )
        yield name, tensor
