"""``runai_streamer``: the model's ``*.safetensors`` read by Run:ai Model Streamer
(``pip install runai-model-streamer``), which reads the files with many concurrent
requests into a bounded CPU buffer and hands the tensors over as they arrive.

``--model-loader-extra-config`` takes vLLM's keys: ``concurrency`` (the streamer's
number of concurrent reads, ``RUNAI_STREAMER_CONCURRENCY``) and ``memory_limit`` (bytes
of CPU buffer, ``RUNAI_STREAMER_MEMORY_LIMIT``: -1 unlimited, 0 the largest tensor's).
They are set in the environment the streamer reads only while it streams.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.default import SafetensorsLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig

INSTALL_HINT = "pip install runai-model-streamer"
# extra-config key -> the streamer's environment variable.
_ENV = {
    "concurrency": "RUNAI_STREAMER_CONCURRENCY",
    "memory_limit": "RUNAI_STREAMER_MEMORY_LIMIT",
}


def _streamer_module() -> Any:
    try:
        import runai_model_streamer
    except ImportError as exc:
        raise ConfigError(
            f"--load-format runai_streamer needs Run:ai Model Streamer ('{INSTALL_HINT}'): {exc}"
        ) from exc
    return runai_model_streamer


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RunaiStreamerLoader(SafetensorsLoader):
    extra_config_keys = frozenset(_ENV)

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        self.settings: dict[str, int] = {}
        for key, lowest in (("concurrency", 1), ("memory_limit", -1)):
            if key not in extra:
                continue
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ConfigError(
                    f"--model-loader-extra-config: {key} must be an integer >= {lowest} "
                    f"for load format 'runai_streamer', got {value!r}"
                )
            self.settings[key] = value

    def download_model(self, model_config: ModelConfig) -> None:
        _streamer_module()
        super().download_model(model_config)

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        streamer_module = _streamer_module()
        files = [str(file) for file in self.weight_files(model_config)]
        # One streaming session for every file: the streamer spreads its reads over them.
        try:
            env = {_ENV[key]: str(value) for key, value in self.settings.items()}
            with _environment(env), streamer_module.SafetensorsStreamer() as streamer:
                streamer.stream_files(files)
                yield from streamer.get_tensors()
        except Exception as exc:  # the streamer's own exception classes derive from it
            given = ", ".join(f"{k}={v}" for k, v in sorted(self.settings.items()))
            raise ConfigError(
                f"Run:ai Model Streamer could not read {model_config.model!r}"
                f"{f' ({given})' if given else ''}: {exc}"
            ) from exc
