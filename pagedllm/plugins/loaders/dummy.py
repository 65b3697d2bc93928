"""``dummy``: random weights, for profiling without a checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelLoader

if TYPE_CHECKING:
    from pagedllm.core.config import LoadConfig, ModelConfig

_LOW, _HIGH = -1e-3, 1e-3


class DummyLoader(ModelLoader):
    """Fills every floating-point parameter uniformly in [-1e-3, 1e-3] (reproducibly:
    seeded by ``--seed``, default 0). Buffers such as rotary tables are left as built."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        if load_config.model_loader_extra_config:
            raise ConfigError(
                "--model-loader-extra-config: the dummy load format takes no options, got "
                f"{sorted(load_config.model_loader_extra_config)}"
            )

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to fetch: only the model's config is needed."""

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        import torch

        generator = torch.Generator().manual_seed(model_config.seed or 0)
        with torch.no_grad():
            for param in model.parameters():
                if param.is_floating_point():
                    values = torch.rand(param.shape, generator=generator, dtype=torch.float32)
                    param.copy_(values * (_HIGH - _LOW) + _LOW)
