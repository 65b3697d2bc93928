"""``--model-impl transformers``: any transformers causal LM on pagedllm's paged KV cache.

transformers' models compute attention through a function looked up by name
(``config._attn_implementation`` in its ``AttentionInterface``). This backend registers
pagedllm's under the name ``pagedllm`` and builds the transformers model with it: every
other module (embeddings, norms, rotary embeddings, MLPs, the head) is transformers' own,
and attention is an :class:`~pagedllm.core.attention.Attention` per layer, which reads and
writes the paged cache through the device's attention backend, as the native models'
layers do. A step's tokens (every request's, flattened) go through the model as one
sequence of ``[1, tokens]`` with their own positions; attention keeps the requests apart
through the step's metadata, so prefix caching, chunked prefill and preemption work
as for the native models. transformers builds no mask and no cache for it.

It takes models whose attention goes through that interface (most of transformers'
decoder-only models). When built, the model runs once on two tokens with a probe for
attention function, which learns each layer's heads, KV heads and head sizes (values
narrower than queries and keys, as in latent attention, are zero-padded to their width;
the KV cache is shaped so: ``kv_cache_shape``) and its soft cap (Gemma 2), and finds what
pagedllm's paged attention cannot compute: layers without attention (recurrent,
convolution, state-space), layer types other than full and sliding-window attention,
attention run twice a layer, an attention mask of the model's own, bidirectional
attention, attention sinks. Those, composite (multimodal) configs and quantization
methods are refused by name before the weights load. The logits are the model's own
forward from its decoder's output on (its head, BERT's transform, Gemma 2's
``final_logit_softcapping``, Cohere's ``logit_scale``, ...); the checkpoint loads by the
names transformers' own loading gives (:mod:`.transformers_weights`).

With tensor parallelism the model's own plan (its config's ``base_model_tp_plan``, which
transformers' models declare) says which linear layers split by output rows
(``colwise``) and which by input columns (``rowwise``): those become pagedllm's
:class:`~pagedllm.core.layers.linear.Linear` layers split so (one all-reduce after each
row-parallel one), each rank then holding its share of the attention heads (transformers'
attention reshapes by the head size) and of the MLP rows; everything else (embeddings,
norms, the head) is whole on every rank. A model without a plan, or whose plan splits
anything otherwise (packed or MoE experts, gathered outputs), is refused by name.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelArchitecture
from pagedllm.distributed.parallel_state import alone, tp_size
from pagedllm.plugins.models.common import layer_sliding_windows

IMPLEMENTATION = "pagedllm"
# transformers' tensor-parallel styles of linear layers, as pagedllm's Linear splits them,
# and those that leave a module whole (on every rank; a vocabulary-parallel embedding too).
_SPLIT_STYLES = {"colwise": "column", "rowwise": "row"}
_WHOLE_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce", "embedding_rowwise"})
# Layer types (a config's ``layer_types``) whose attention pagedllm computes.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Hidden states the decoder gives back instead of computing them (the model's forward
# then runs its head on them: compute_logits).
_HEAD_INPUT: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "head_input", default=None
)
# The step being computed (its attention metadata and the model's attention layers), or
# the probe that learns the model's attention when it is built.
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("step")


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pagedllm's paged attention:
    ``query`` ``[1, heads, tokens, d]``, ``key``/``value`` ``[1, kv_heads, tokens, d]``
    (values' ``d`` may differ: multi-head latent attention); returns
    ``[1, tokens, heads, values' d]``."""
    step = _STEP.get()
    if isinstance(step, _Probe):
        return step.record(module, query, key, value, attention_mask, kwargs), None
    metadata, layers = step
    layer = layers[module.layer_idx]
    if scaling is not None:
        layer.scale = scaling
    layer.logits_soft_cap = kwargs.get("softcap")
    _, heads, tokens, _ = query.shape
    width, value_width = layer.head_dim, value.shape[-1]
    if (heads, key.shape[1]) != (layer.num_heads, layer.num_kv_heads) or max(
        query.shape[-1], value_width
    ) > width:  # (the KV cache is shaped as the probe found the layer)
        raise RuntimeError(f"layer {module.layer_idx}'s attention changed shape")

    def rows(x: torch.Tensor) -> torch.Tensor:  # [1, h, T, d] -> [T, h * width]
        x = x[0].transpose(0, 1)
        if x.shape[-1] < width:  # (zeros change neither scores nor outputs)
            x = nn.functional.pad(x, (0, width - x.shape[-1]))
        return x.reshape(tokens, -1)

    out = layer(rows(query), rows(key), rows(value), metadata)
    return out.view(1, tokens, heads, width)[..., :value_width], None


@dataclass(frozen=True, slots=True)
class _LayerShape:
    """One layer's attention as the model calls it (this rank's heads)."""

    heads: int
    kv_heads: int
    head_dim: int  # of queries and keys
    value_head_dim: int
    soft_cap: float | None


class _Probe:
    """Records a forward's attention calls, layer by layer, and what in them pagedllm's
    paged attention cannot compute."""

    def __init__(self) -> None:
        self.layers: dict[int, _LayerShape] = {}
        self.problems: dict[str, None] = {}  # (ordered, without repeats)

    def note(self, problem: str) -> None:
        self.problems[problem] = None

    def record(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        name = type(module).__name__
        index = getattr(module, "layer_idx", None)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        problems = {
            f"{name} has no layer_idx": index is None,
            f"layer {index}'s attention runs more than once a forward (a recurrent or "
            "shared stack)": index in self.layers,
            f"{name} makes its own attention mask": attention_mask is not None,
            f"{name} attends in both directions (is_causal=False: an encoder, or a config "
            "with is_decoder=False)": not causal,
            "attention sinks (gpt-oss and the like)": any(
                kwargs.get(n) is not None for n in ("s_aux", "sinks")
            ),
            f"{name}'s queries and keys differ in size": query.shape[-1] != key.shape[-1],
        }
        for problem, found in problems.items():
            if found:
                self.note(problem)
        if index is not None:
            cap = kwargs.get("softcap") or None
            heads, kv_heads = query.shape[1], key.shape[1]
            shape = _LayerShape(heads, kv_heads, query.shape[-1], value.shape[-1], cap)
            self.layers.setdefault(index, shape)
        _, heads, tokens, _ = query.shape
        return query.new_zeros(1, tokens, heads, value.shape[-1])


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build: none (the step's metadata holds the causal
    structure of every request)."""
    return None


def register_attention() -> None:
    """Make ``attn_implementation="pagedllm"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, _no_mask)


@functools.cache
def _given_output() -> type:
    """A base model's output holding only given hidden states. One class per process:
    transformers registers each ``ModelOutput`` subclass as a torch pytree node."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class Given(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> None:  # (the outputs it did not compute)
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return Given


def _decoder_or_given(forward: Any) -> Any:
    """``forward`` (a base model's), or the hidden states ``_HEAD_INPUT`` holds."""
    given_output = _given_output()

    def decoder(*args: Any, **kwargs: Any) -> Any:
        given = _HEAD_INPUT.get()
        if given is None:
            return forward(*args, **kwargs)
        return given_output(last_hidden_state=given[None])

    return decoder


def _body(hf: Any) -> nn.Module | None:
    """The model without its head: its base model, else its one transformers model
    among its children (where ``base_model_prefix`` names none)."""
    from transformers import PreTrainedModel

    if hf.base_model is not hf:
        return hf.base_model
    children = [m for m in hf.children() if isinstance(m, PreTrainedModel)]
    return children[0] if len(children) == 1 else None


def _refuse_composite(config: Any, name: str) -> None:
    if config.get_text_config() is not config:
        parts = [n for n in config.sub_configs if getattr(config, n, None) is not None]
        raise ConfigError(
            f"--model-impl transformers runs plain language models; {name}'s config is "
            f"composite ({', '.join(parts)}: a multimodal model or a drafter)"
        )


def _tp_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


class TransformersForCausalLM(nn.Module, ModelArchitecture):
    """A transformers ``AutoModelForCausalLM`` built from the config, with pagedllm's
    attention. Its parameters keep transformers' names (under ``hf.``), which are the
    checkpoint's."""

    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, config: Any, size: int, *, experts: bool = False) -> None:
        """Its config's plan splits only linear layers, by rows or columns, and the
        heads, the KV heads and the intermediate size divide by ``size``."""
        super().check_tensor_parallel(config, size)
        if size == 1:
            return
        _refuse_composite(config, (config.architectures or [config.model_type])[0])
        name = f"--model-impl transformers with --tensor-parallel-size {size}"
        plan = _tp_plan(config)
        if not plan:
            raise ConfigError(
                f"{name}: {config.model_type} declares no tensor-parallel plan "
                "(base_model_tp_plan); use its native implementation or one rank"
            )
        odd = sorted(
            {s for s in plan.values() if s not in _SPLIT_STYLES and s not in _WHOLE_STYLES}
        )
        if odd:
            raise ConfigError(
                f"{name}: its plan splits layers as {odd}, which pagedllm does not (it "
                f"splits linear layers {sorted(_SPLIT_STYLES)})"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        sizes = {"attention heads": heads, "KV heads": kv_heads}
        sizes["intermediate size"] = getattr(config, "intermediate_size", None) or 0
        problems = [
            f"its {what} {n} do not divide by {size}" for what, n in sizes.items() if n % size
        ]
        if problems:
            raise ConfigError(f"{name}: " + "; ".join(problems))

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ConfigError(
                f"--model-impl transformers runs unquantized weights; --quantization "
                f"{quant_config.name} needs a native implementation"
            )
        import transformers
        from transformers import PreTrainedModel

        try:  # (and the loading rules transformers_weights takes from transformers 5)
            from transformers.initialization import no_init_weights
        except ImportError:
            raise ConfigError(
                f"--model-impl transformers needs transformers 5 or newer (installed: "
                f"{transformers.__version__})"
            ) from None

        register_attention()
        # The config's own class (what transformers' from_pretrained builds), else the
        # causal LM of its config type.
        named = [getattr(transformers, a, None) for a in config.architectures or []]
        model_class = next((c for c in named if isinstance(c, type)), None)
        if model_class is None:
            mapping = transformers.AutoModelForCausalLM._model_mapping
            model_class = mapping[type(config)]
        _refuse_composite(config, model_class.__name__)
        kinds = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
        if kinds:
            raise ConfigError(
                f"--model-impl transformers: {model_class.__name__} has {', '.join(kinds)} "
                f"layers (its config's layer_types), which pagedllm's paged attention does "
                f"not compute (it runs {' and '.join(sorted(_ATTENTION_LAYER_TYPES))} layers)"
            )
        unsupported = ConfigError(
            f"{config.architectures or config.model_type} does not compute attention through "
            "transformers' attention interface, which --model-impl transformers needs"
        )
        try:
            with no_init_weights():
                self.hf = model_class._from_config(
                    config, attn_implementation=IMPLEMENTATION, dtype=torch.get_default_dtype()
                )
        except (KeyError, ValueError) as exc:  # (a model with its own attention classes)
            raise unsupported from exc
        if self.hf.config._attn_implementation != IMPLEMENTATION:
            raise unsupported
        self.config = config
        self.hf.tie_weights()
        body = _body(self.hf)
        if body is None:
            raise ConfigError(
                f"--model-impl transformers: {model_class.__name__} has no base model "
                f"(base_model_prefix {self.hf.base_model_prefix!r}) to run without its head"
            )
        self._body = (body,)  # (a tuple: registered where the model put it)
        # The head runs in the model's own forward, on hidden states its decoder gives
        # back (which some forwards call directly: OPT's model.decoder).
        decoder = body.get_decoder() if hasattr(body, "get_decoder") else body
        for module in {body, decoder if isinstance(decoder, PreTrainedModel) else body}:
            module.forward = _decoder_or_given(module.forward)
        if tp_size() > 1:
            self._split_by_plan(config)
        shapes = self._probe(model_class.__name__, config.num_hidden_layers)
        windows = layer_sliding_windows(config, disable_sliding_window)
        # The KV cache has one shape for every layer: heads and values narrower than the
        # widest are zero-padded to its width (zeros change neither scores nor outputs).
        # (A layer's soft cap is what the model passes at each call; set here too, so that
        # the engine refuses an attention backend that cannot compute it before the start.)
        width = max(max(s.head_dim, s.value_head_dim) for s in shapes)
        self.attn = nn.ModuleList(
            Attention(s.heads, width, s.head_dim**-0.5, s.kv_heads, i, windows[i], s.soft_cap)
            for i, s in enumerate(shapes)
        )

    def _probe(self, name: str, num_layers: int) -> list[_LayerShape]:
        """Each layer's attention, learnt by running the (not yet loaded) model on two
        tokens, head included; a model whose attention pagedllm cannot compute is
        refused by name."""
        probe = _Probe()
        device = next(self.hf.parameters()).device
        # (Alone: the ranks build their shards at their own pace, so a collective in the
        # probe would wait for, or pair with, another rank's unrelated one.)
        with torch.no_grad(), alone():
            for param in self.hf.parameters():  # (not loaded yet: whatever memory held)
                param.zero_()
            try:  # (the model's own code, on pagedllm's attention)
                ids = torch.tensor([0, 1], device=device)
                logits = self.compute_logits(self._run(ids, torch.arange(2, device=device), probe))
            except Exception as exc:
                probe.note(f"its forward fails with pagedllm's attention ({exc})")
            else:
                if logits.shape[0] != 2:
                    probe.note(f"its head gives {tuple(logits.shape)} logits for 2 tokens")
        missing = sorted(set(range(num_layers)) - set(probe.layers))
        if missing:
            probe.note(
                f"its layers {missing} compute no attention through transformers' attention "
                "interface (recurrent, convolution or state-space layers)"
            )
        extra = sorted(set(probe.layers) - set(range(num_layers)))
        if extra:
            probe.note(f"it has attention layers {extra} past its {num_layers}")
        kv_heads = sorted({shape.kv_heads for shape in probe.layers.values()})
        if len(kv_heads) > 1:
            probe.note(f"its layers have different numbers of KV heads {kv_heads}")
        if probe.problems:
            raise ConfigError(
                f"--model-impl transformers cannot run {name}: " + "; ".join(probe.problems)
            )
        return [probe.layers[i] for i in range(num_layers)]

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """What the probe found (the config's attributes may not say it: latent
        attention's head sizes, padded values)."""
        return len(self.attn), self.attn[0].num_kv_heads, self.attn[0].head_dim

    def _split_by_plan(self, config: Any) -> None:
        """Replace the linear layers the config's plan splits with pagedllm's, split so
        over the tensor-parallel ranks (their parameters keep the names)."""
        from pagedllm.core.layers.linear import Linear

        base = self.hf.base_model
        prefix = self.hf.base_model_prefix
        rules = [
            (re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
            for pattern, style in _tp_plan(config).items()
        ]
        for name, module in list(base.named_modules()):
            style = next((style for rule, style in rules if rule.match(name)), None)
            if style is None or style in _WHOLE_STYLES:
                continue
            if type(module) is not nn.Linear:
                raise ConfigError(
                    f"--model-impl transformers: {name} ({type(module).__name__}) is split "
                    f"{style!r} by the model's plan; pagedllm splits linear layers only"
                )
            parent, _, attr = name.rpartition(".")
            layer = Linear(
                module.in_features,
                module.out_features,
                module.bias is not None,
                None,
                f"{prefix}.{name}" if prefix else name,
                parallel=_SPLIT_STYLES[style],
            )
            setattr(base.get_submodule(parent) if parent else base, attr, layer)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        token = _STEP.set(step)
        try:
            out = self._body[0](
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        return self._run(input_ids, positions, (attn_metadata, self.attn))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The model's own forward from its decoder's output on: the head and whatever the
        model does around it (BERT's transform, Gemma 2's soft-capping, Cohere's
        ``logit_scale``), the decoder giving back ``hidden_states``."""
        token = _HEAD_INPUT.set(hidden_states)
        try:
            ids = torch.zeros(
                1, hidden_states.shape[0], dtype=torch.long, device=hidden_states.device
            )
            out = self.hf(input_ids=ids, use_cache=False)
        finally:
            _HEAD_INPUT.reset(token)
        return out.logits[0].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from pagedllm.plugins.models.transformers_weights import load_by_model_names

        return {f"hf.{name}" for name in load_by_model_names(self.hf, weights)}
