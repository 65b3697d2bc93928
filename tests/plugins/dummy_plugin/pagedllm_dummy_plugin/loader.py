"""A load format: weights stored as nested lists in ``<model dir>/weights.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.core.interfaces import ModelLoader


# [docs:loader]
class JsonWeightsLoader(ModelLoader):
    """Weights stored as nested lists in ``<model dir>/weights.json``; the model's
    ``config.json`` and tokenizer sit beside it as usual."""

    def __init__(self, load_config):
        super().__init__(load_config)
        unknown = set(load_config.model_loader_extra_config) - {"dtype"}
        if unknown:
            raise ValueError(f"dummyfmt does not understand {sorted(unknown)}")
        self.dtype = getattr(torch, load_config.model_loader_extra_config.get("dtype", "float32"))

    def _file(self, model_config) -> Path:
        return Path(model_config.model) / "weights.json"

    def download_model(self, model_config):
        # Nothing to download: a local directory or a clear error, never the network.
        if not self._file(model_config).is_file():
            raise FileNotFoundError(f"{self._file(model_config)} does not exist")

    def load_weights(self, model, model_config):
        data = json.loads(self._file(model_config).read_text())
        tensors = ((name, torch.tensor(v, dtype=self.dtype)) for name, v in data.items())
        loaded = model.load_weights(tensors)
        missing = {name for name, _ in model.named_parameters()} - set(loaded)
        if missing:
            raise ValueError(f"weights.json lacks {sorted(missing)}")


# [/docs:loader]
