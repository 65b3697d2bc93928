"""The ``safetensors``, ``pt`` and ``auto`` load formats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.base import FileLoader

if TYPE_CHECKING:
    import torch


class SafetensorsLoader(FileLoader):
    patterns = ("*.safetensors",)
    index_name = "model.safetensors.index.json"

    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class PtLoader(FileLoader):
    patterns = ("*.bin", "*.pt")
    index_name = "pytorch_model.bin.index.json"

    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


class AutoLoader(FileLoader):
    """safetensors when the model has them, else PyTorch ``.bin``/``.pt`` files."""

    def __init__(self, load_config) -> None:
        super().__init__(load_config)
        self._safetensors = SafetensorsLoader(load_config)
        self._pt = PtLoader(load_config)
        self._chosen: FileLoader | None = None

    def files_in(self, directory: Path) -> list[Path]:
        try:
            files = self._safetensors.files_in(directory)
            self._chosen = self._safetensors
        except ConfigError:
            try:
                files = self._pt.files_in(directory)
            except ConfigError:
                raise ConfigError(
                    f"no safetensors or PyTorch weight files in {directory}"
                ) from None
            self._chosen = self._pt
        return files

    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        assert self._chosen is not None, "files_in() runs before read_file()"
        return self._chosen.read_file(file)
