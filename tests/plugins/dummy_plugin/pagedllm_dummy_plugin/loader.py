import json
from pathlib import Path

from pagedllm.core.interfaces import ModelLoader


class JsonWeightsLoader(ModelLoader):
    """Weights stored as nested lists in ``<model dir>/weights.json``."""

    def _file(self, model_config) -> Path:
        return Path(model_config.model) / "weights.json"

    def download_model(self, model_config):
        if not self._file(model_config).is_file():
            raise FileNotFoundError(f"{self._file(model_config)} does not exist")

    def load_weights(self, model, model_config):
        import torch

        data = json.loads(self._file(model_config).read_text())
        loaded = model.load_weights((name, torch.tensor(v)) for name, v in data.items())
        missing = {n for n, _ in model.named_parameters()} - set(loaded)
        if missing:
            raise ValueError(f"weights.json lacks {sorted(missing)}")
