"""``npcache``: PyTorch checkpoints converted once to memory-mapped NumPy files."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.plugins.loaders.default import PtLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import ModelConfig

_INDEX = "npcache_index.json"


class NpcacheLoader(PtLoader):
    """Reads ``.bin`` files the first time and keeps each tensor as a ``.npy`` file under
    ``<download-dir or model dir>/npcache``; later loads memory-map those."""

    def cache_dir(self, model_config: ModelConfig) -> Path:
        model_dir = self.model_dir(model_config)
        base = Path(self.load_config.download_dir) if self.load_config.download_dir else model_dir
        key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
        return base / "npcache" / key

    def download_model(self, model_config: ModelConfig) -> None:
        if not (self.cache_dir(model_config) / _INDEX).is_file():
            super().download_model(model_config)

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        import torch

        cache = self.cache_dir(model_config)
        index_file = cache / _INDEX
        if not index_file.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            index: dict[str, dict[str, str]] = {}
            for i, (name, tensor) in enumerate(super().iter_weights(model_config)):
                # NumPy has no bfloat16: such tensors are stored as their raw 16-bit words.
                stored = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
                file = f"{i}.npy"
                np.save(cache / file, stored.detach().contiguous().numpy())
                index[name] = {"file": file, "dtype": str(tensor.dtype).removeprefix("torch.")}
            tmp = index_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(index), encoding="utf-8")
            tmp.replace(index_file)
        index = json.loads(index_file.read_text(encoding="utf-8"))
        for name, entry in index.items():
            array = np.load(cache / entry["file"], mmap_mode="r")
            tensor = torch.from_numpy(np.array(array))
            if entry["dtype"] == "bfloat16":
                tensor = tensor.view(torch.bfloat16)
            yield name, tensor
