"""A checkpoint's tensors into a transformers model under the names transformers'
own loading gives them.

A checkpoint's names are not always the model's: transformers renames some on load
(GPT-NeoX's ``embed_out`` is its ``lm_head``, ``gamma``/``beta`` are ``weight``/``bias``,
a base model's names gain or lose the ``base_model_prefix``) and converts others (one
tensor per expert merged into one stacked tensor, fused projections split), by the
rules each model class registers (``transformers.conversion_mapping``). Those rules are
taken from transformers itself (:func:`get_model_conversion_mapping`), and applied with
its own functions, so a checkpoint loads as ``from_pretrained`` would load it. The
tensors stream: only those a converter combines are held until the end.

Tied weights follow ``from_pretrained`` too (``all_tied_weights_keys``, target ->
source): a head tied to the embedding takes the embedding's tensor; a checkpoint
holding only the head's fills both; one holding both, with different values, unties
them (as transformers does, with its warning).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.weights import copy_tensor

logger = logging.getLogger(__name__)


def load_by_model_names(hf: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy ``weights`` (checkpoint name, tensor) into transformers model ``hf``; return
    the names (``hf.named_parameters()``'s) of the parameters filled. A tensor the model
    has no place for, and does not declare ignorable, is a ``ConfigError`` naming it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    # Parameters and persistent buffers by every name (tied ones under each of theirs).
    targets: dict[str, torch.Tensor] = hf.state_dict(keep_vars=True)
    tied: dict[str, str] = dict(getattr(hf, "all_tied_weights_keys", None) or {})
    ignored = [re.compile(p) for p in getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or []]
    pending: dict[str, Any] = {}  # first target name -> converter collecting its tensors
    held: dict[str, tuple[str, torch.Tensor]] = {}  # tied target -> (checkpoint name, tensor)
    filled: set[int] = set()  # ids of the tensors filled

    def put(key: str, tensor: torch.Tensor, name: str) -> None:
        if key in tied:  # (decided once the whole checkpoint is read)
            held[key] = (name, tensor)
            return
        copy_tensor(targets[key], tensor, name)
        filled.add(id(targets[key]))

    for name, tensor in weights:
        key, pattern = rename_source_key(name, renamings, converters, hf.base_model_prefix, targets)
        if key not in targets and name in targets:  # (a rule that did not apply here)
            key, pattern = name, None
        if key not in targets:
            if any(p.search(key) or p.search(name) for p in ignored):
                continue
            known_as = f" (transformers' name for it: {key!r})" if key != name else ""
            raise ConfigError(
                f"the checkpoint has a weight {name!r} this model does not know{known_as}"
            )
        if pattern is None:
            put(key, tensor, name)
        else:
            converter = pending.setdefault(key, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(key, name, pattern, tensor)
    for key, converter in pending.items():
        try:
            converted = converter.convert(key, model=hf, config=hf.config)
        except Exception as exc:  # (transformers' own operations, on this checkpoint's tensors)
            message = f"the checkpoint's weights for {key!r} do not convert: {exc}"
            raise ConfigError(message) from exc
        for target, tensor in converted.items():
            if target not in targets:
                raise ConfigError(
                    f"the checkpoint's weights for {key!r} convert to {target!r}, which this "
                    "model does not know"
                )
            put(target, tensor[0] if isinstance(tensor, list) else tensor, key)
    for target, (name, tensor) in held.items():
        source, own = targets[tied[target]], targets[target]
        if own is not source:  # (not tied after all)
            copy_tensor(own, tensor, name)
            filled.add(id(own))
        elif id(source) not in filled:  # (the checkpoint names the head only)
            copy_tensor(source, tensor, name)
            filled.add(id(source))
        elif not torch.equal(source.detach(), tensor.to(source)):
            logger.warning(
                "the checkpoint's %s and %s differ, although tied by the config: not tied",
                target,
                tied[target],
            )
            _untie(hf, target, tensor, name)
            filled.add(id(hf.get_parameter(target)))
    return {n for n, p in hf.named_parameters() if id(p) in filled}


def _untie(hf: nn.Module, target: str, tensor: torch.Tensor, name: str) -> None:
    parent, _, attr = target.rpartition(".")
    module = hf.get_submodule(parent)
    param = getattr(module, attr)
    own = nn.Parameter(torch.empty_like(param), requires_grad=False)
    copy_tensor(own, tensor, name)
    setattr(module, attr, own)
