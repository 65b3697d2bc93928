"""The engine's LoRA adapters: loading them (peft's format), a CPU cache of loaded ones
(``--max-cpu-loras``, least recently used evicted), and ``--max-loras`` slots on the
device holding the adapters a step runs with (filled on demand, the least recently used
idle slot reused).

Every linear layer (an untied vocabulary head included) and embedding table of the model
gets the slot tensors ``A`` ``[slots, max_rank, in]`` and ``B`` ``[slots, out, max_rank]``
(an adapter of a lower rank is zero-padded: the product is exact; an embedding's ``in``
is the vocabulary) and a scale per slot (``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA). Before each step the runner hands the manager the step's tokens and requests;
each layer then adds its deltas (:mod:`pagedllm.lora.ops`) to its output, also inside
fused products (Q/K/V, gate/up); the head, which computes only some rows, sees their
groups (:meth:`LoRAManager.rows`). The native decoder layer (which bypasses the modules)
is turned off.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.layers.linear import Linear, rank_share
from pagedllm.lora.ops import LoRABatch, add_lora, add_lora_embedding
from pagedllm.lora.request import LoRARequest

# peft settings pagedllm reads; any other set to a non-default value is refused by name.
_NEUTRAL = {
    "bias": "none",
    "fan_in_fan_out": False,
    "use_dora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
}


# peft's tensor names: linear layers' lora_A/B.weight, embeddings' lora_embedding_A/B.
_PARTS = {
    "lora_A": "A",
    "lora_B": "B",
    "lora_embedding_A": "A",
    "lora_embedding_B": "B",
}


class LoRASlots:
    """One linear layer's adapter slots (see the module's docstring)."""

    def __init__(
        self, in_size: int, out_size: int, slots: int, rank: int, dtype: torch.dtype, device: Any
    ) -> None:
        self.a = torch.zeros(slots, rank, in_size, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_size, rank, dtype=dtype, device=device)
        self.scale = torch.zeros(slots, dtype=torch.float32, device=device)

    def add_embedding(self, y: torch.Tensor, ids: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        return add_lora_embedding(y, ids, batch, self.a, self.b, self.scale.to(y.dtype))

    def add(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        return add_lora(y, x, batch, self.a, self.b, self.scale.to(y.dtype))


class LoRAAdapter:
    """A loaded adapter: ``weights`` maps a layer's prefix to ``(A, B, scale)`` (the full
    layer's matrices)."""

    def __init__(self, request: LoRARequest, weights: dict[str, tuple[Any, Any, float]]) -> None:
        self.request = request
        self.weights = weights

    @classmethod
    def load(
        cls, request: LoRARequest, sizes: dict[str, tuple[int, int]], max_rank: int
    ) -> LoRAAdapter:
        """Read and check an adapter against the model's layers ``sizes`` (by prefix;
        with pipeline stages, every stage's)."""
        from pagedllm.core.model_files import resolve_model_path

        def fail(message: str) -> InvalidRequestError:
            return InvalidRequestError(
                "lora_request", f"LoRA adapter {request.lora_name!r}: {message}"
            )

        try:
            path = resolve_model_path(request.lora_path)
        except ConfigError as exc:
            raise fail(str(exc)) from None
        directory = path if path.is_dir() else path.parent
        config_file = directory / "adapter_config.json"
        if not config_file.is_file():
            raise fail(f"no adapter_config.json in {directory}")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if config.get("peft_type", "LORA") != "LORA":
            raise fail(f"peft_type {config.get('peft_type')!r} is not LORA")
        for key, neutral in _NEUTRAL.items():
            if config.get(key, neutral) not in (neutral, None) and config.get(key) != neutral:
                raise fail(f"{key}={config[key]!r} is not supported")
        rank = int(config["r"])
        if rank > max_rank:
            raise fail(f"rank {rank} is above --max-lora-rank {max_rank}")
        alpha = float(config.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        tensors = _read_tensors(directory)
        pairs: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
        for name, tensor in tensors.items():
            if "lora_magnitude" in name:
                raise fail(f"{name}: DoRA is not supported")
            if ".base_layer." in name:
                # peft saves the base embedding / head beside their adapters: the model's
                # own (checked by shape; a resized vocabulary is an adapter adding tokens).
                prefix = name.split(".base_layer.")[0].removeprefix("base_model.model.")
                in_size, out_size = sizes.get(prefix, (None, None))
                if tuple(tensor.shape) not in ((out_size, in_size), (in_size, out_size)):
                    raise fail(f"{name}: adapters that change the vocabulary are not supported")
                continue
            for part, role in _PARTS.items():
                marker = f".{part}"
                head, found, rest = name.partition(marker)
                if found and rest in ("", ".weight"):
                    pairs[head.removeprefix("base_model.model.")][role] = tensor
                    break
            else:
                raise fail(f"unexpected tensor {name}")
        weights = {}
        for prefix, pair in pairs.items():
            if prefix not in sizes:
                raise fail(
                    f"the model has no adaptable layer {prefix!r} (a tied or quantized head?)"
                )
            in_size, out_size = sizes[prefix]
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise fail(f"{prefix} lacks its A or B matrix")
            if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
                raise fail(
                    f"{prefix}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                    f"[{in_size} -> {out_size}] at rank {rank}"
                )
            weights[prefix] = (a, b, scale)
        if not weights:
            raise fail("no LoRA weights")
        return cls(request, weights)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / "adapter_model.safetensors"
    if file.is_file():
        from safetensors.torch import load_file

        return load_file(file)
    file = directory / "adapter_model.bin"
    if file.is_file():
        return torch.load(file, map_location="cpu", weights_only=True)
    raise InvalidRequestError(
        "lora_request", f"no adapter_model.safetensors or .bin in {directory}"
    )


class LoRAManager:
    def __init__(self, model: Any, config: Any, dtype: torch.dtype, device: Any) -> None:
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        from pagedllm.core.layers.embedding import VocabEmbedding

        # The modules adapters may target, by prefix (the checkpoint's names): linear
        # layers (the vocabulary head included when it is one) and embedding tables,
        # with the (in, out) sizes of their A and B.
        self.layers: dict[str, Any] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        for module in model.modules():
            # (With tensor parallelism a linear layer's slots hold this rank's share of
            # each adapter: B's rows of a column-parallel layer, A's columns of a
            # row-parallel one; an embedding's adapter applies to the whole lookup.)
            if isinstance(module, Linear) and module.prefix:
                sizes = (module.full_input_size, module.full_output_size)
                local = (module.input_size, module.output_size)
            elif isinstance(module, VocabEmbedding) and module.prefix:
                sizes = local = (module.num_embeddings, module.embedding_dim)
            else:
                continue
            if module.method is not None:
                raise ConfigError(
                    f"--enable-lora: {module.prefix} is quantized; LoRA runs on unquantized weights"
                )
            module.lora = LoRASlots(*local, self.max_loras, self.max_rank, dtype, device)
            module.lora_manager = self
            self.layers[module.prefix] = module
            self.sizes[module.prefix] = sizes
        for module in model.modules():
            if hasattr(module, "_native"):
                module._native = False  # (the native layer would skip the adapters)
        self.cpu: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot
        self.free_slots = list(range(self.max_loras))
        # The adapters of the current step's tokens (None: no adapter in the step).
        self.batch: LoRABatch | None = None
        # How many unfinished requests run with each adapter (hold / release): those
        # adapters stay loaded.
        self.in_use: collections.Counter[int] = collections.Counter()
        self.device = device
        # The current step's slot fills ``(slot, adapter)`` and each request's slot (-1:
        # none; empty without adapters): what the other ranks follow (the adapters'
        # weights go to them with the fills, so every rank runs the very tensors rank 0
        # read and checked).
        self.step_fills: list[tuple[int, LoRAAdapter]] = []
        self.step_slots: list[int] = []

    # ---------------------------------------------------------------- adapters

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of ``request`` (loading it, evicting the least recently used
        beyond --max-cpu-loras that no slot holds and no unfinished request needs: an
        admitted request runs the adapter read when it came, even if its files have
        changed or gone since)."""
        loaded = self.cpu.get(request.lora_int_id)
        if loaded is not None and loaded.request.lora_path != request.lora_path:
            raise InvalidRequestError(
                "lora_request",
                f"LoRA id {request.lora_int_id} is already {loaded.request.lora_name!r} at "
                f"{loaded.request.lora_path}",
            )
        if loaded is None:
            loaded = LoRAAdapter.load(request, self.sizes, self.max_rank)
            self.cpu[request.lora_int_id] = loaded
            self._trim(request.lora_int_id)
        self.cpu.move_to_end(request.lora_int_id)
        return loaded

    def _trim(self, keep: int | None = None) -> None:
        """The least recently used adapters beyond --max-cpu-loras go, but not one in a
        slot, one an unfinished request needs, or ``keep``: the cache may exceed the
        limit until they are done (then the next step trims it)."""
        if len(self.cpu) <= self.max_cpu:
            return
        needed = self.in_use
        idle = [i for i in self.cpu if i not in self.slots and i not in needed and i != keep]
        for victim in idle[: len(self.cpu) - self.max_cpu]:
            del self.cpu[victim]

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot too); False when it was not loaded."""
        found = self.cpu.pop(lora_id, None) is not None
        slot = self.slots.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return found

    def _slot(self, adapter: LoRAAdapter, busy: set[int]) -> int:
        lora_id = adapter.request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slots if self.slots[i] not in busy)
            slot = self.slots.pop(victim)
        self._fill(slot, adapter)
        self.step_fills.append((slot, adapter))
        self.slots[lora_id] = slot
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into every layer's ``slot`` (this rank's share of it)."""
        for prefix, layer in self.layers.items():
            slots = layer.lora
            slots.a[slot].zero_()
            slots.b[slot].zero_()
            slots.scale[slot] = 0.0
            weights = adapter.weights.get(prefix)
            if weights is not None:
                a, b, scale = weights
                if isinstance(layer, Linear):
                    name = f"{prefix} of LoRA adapter {adapter.request.lora_name!r}"
                    a = rank_share(layer.weight, a, name, dims=(1,))
                    b = rank_share(layer.weight, b, name, dims=(0,))
                rank = a.shape[0]
                slots.a[slot, :rank].copy_(a)
                slots.b[slot, :, :rank].copy_(b)
                slots.scale[slot] = scale

    # -------------------------------------------------------------------- steps

    @contextlib.contextmanager
    def rows(self, rows: torch.Tensor) -> Iterator[None]:
        """Within: the adapters of ``rows`` of the step's tokens (the vocabulary head sees
        only the rows it computes logits for)."""
        saved = self.batch
        if saved is not None:
            selected = LoRABatch.from_slots(saved.slots.index_select(0, rows))
            self.batch = selected if selected.groups else None
        try:
            yield
        finally:
            self.batch = saved

    def hold(self, lora_id: int) -> None:
        """An unfinished request runs with adapter ``lora_id``: keep it loaded."""
        self.in_use[lora_id] += 1

    def release(self, lora_id: int) -> None:
        """A request that ran with adapter ``lora_id`` finished."""
        self.in_use[lora_id] -= 1
        if self.in_use[lora_id] <= 0:
            del self.in_use[lora_id]

    def set_step(self, requests_and_lengths: list[tuple[LoRARequest | None, int]]) -> None:
        """The step's requests' adapters (in token order, None for the base model, with
        their token counts): each adapter gets a slot and the rows of its requests'
        tokens."""
        self.step_fills = []
        counts = [count for _, count in requests_and_lengths]
        adapters = [
            None if lora is None else self.adapter(lora) for lora, _ in requests_and_lengths
        ]
        if len({a.request.lora_int_id for a in adapters if a is not None}) > self.max_loras:
            raise RuntimeError("more adapters in one step than --max-loras")
        busy: set[int] = set()
        request_slots = []
        for adapter in adapters:
            slot = -1 if adapter is None else self._slot(adapter, busy)
            if slot >= 0:
                busy.add(slot)
            request_slots.append(slot)
        self.step_slots = request_slots if busy else []
        self._set_batch(self.step_slots, counts)
        self._trim()

    def follow_step(
        self, fills: list[tuple[int, LoRAAdapter]], request_slots: list[int], counts: list[int]
    ) -> None:
        """A rank above 0 (a tensor-parallel rank, a pipeline stage): fill the slots rank
        0 filled this step, with the adapters it sent, and run each request with the slot
        rank 0 gave it. Rank 0 itself calls it without ``fills`` for a pipeline's
        micro-batches (and for the whole step again before its logits)."""
        for slot, adapter in fills:
            self._fill(slot, adapter)
        self._set_batch(request_slots, counts)

    def _set_batch(self, request_slots: list[int], counts: list[int]) -> None:
        """The step's :class:`LoRABatch` from each request's slot (-1: none; an empty
        list: no adapter in the step) and token count."""
        if not request_slots or max(request_slots) < 0:  # (a micro-batch may have none)
            self.batch = None
            return
        rows: dict[int, list[int]] = {}
        offset = 0
        for slot, count in zip(request_slots, counts, strict=True):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(offset, offset + count))
            offset += count
        slots = torch.full((offset,), -1, dtype=torch.long, device=self.device)
        groups = []
        for slot, indices in rows.items():
            tensor = torch.tensor(indices, dtype=torch.long, device=self.device)
            slots[tensor] = slot
            groups.append((slot, tensor))
        self.batch = LoRABatch(slots, groups)


def make_lora_manager(model: Any, config: Any, dtype: torch.dtype, device: Any) -> LoRAManager:
    """The manager of ``model``'s adapters for the engine's ``--enable-lora`` settings
    (``config``: its LoRAConfig), with slots in ``--lora-dtype`` (``auto``: the model's
    ``dtype``)."""
    if config.lora_dtype != "auto":
        dtype = getattr(torch, config.lora_dtype)
    return LoRAManager(model, config, dtype, device)
