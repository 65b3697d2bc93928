"""The ``safetensors``, ``pt`` and ``auto`` load formats."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.model_files import resolve_model_path
from pagedllm.plugins.loaders.base import FileLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import ModelConfig


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
    """safetensors when the model has them, else PyTorch ``.bin``/``.pt`` files, else
    GGUF (a ``.gguf`` path, or a directory whose only weights are one ``.gguf`` file)."""

    # Keys for the GGUF loader (an error for any other checkpoint).
    extra_config_keys = frozenset({"dequantize"})

    def __init__(self, load_config) -> None:
        super().__init__(load_config)
        plain = dataclasses.replace(
            load_config,
            model_loader_extra_config={
                k: v
                for k, v in load_config.model_loader_extra_config.items()
                if k not in self.extra_config_keys
            },
        )
        self._safetensors = SafetensorsLoader(plain)
        self._pt = PtLoader(plain)
        self._chosen: FileLoader | None = None
        self._gguf: dict[str, Any] = {}

    def gguf_loader(self, model_config: ModelConfig) -> Any:
        """The GGUF loader when the model is a GGUF file, else ``None``."""
        if model_config.model not in self._gguf:
            from pagedllm.plugins.loaders.gguf import GGUFLoader
            from pagedllm.plugins.loaders.gguf_file import find_gguf_file

            path = resolve_model_path(
                model_config.model,
                revision=model_config.revision,
                download_dir=self.load_config.download_dir,
            )
            use = path.is_file() and path.suffix.lower() == ".gguf"
            if path.is_dir() and any(path.glob("*.gguf")):
                try:
                    self.files_in(path)
                except ConfigError:
                    use = find_gguf_file(path) is not None
            given = set(self.load_config.model_loader_extra_config) & self.extra_config_keys
            if given and not use:
                raise ConfigError(
                    f"--model-loader-extra-config: {sorted(given)} only apply to GGUF "
                    f"checkpoints, and {model_config.model!r} is not one"
                )
            self._gguf[model_config.model] = GGUFLoader(self.load_config) if use else None
        return self._gguf[model_config.model]

    def download_model(self, model_config: ModelConfig) -> None:
        gguf = self.gguf_loader(model_config)
        if gguf is not None:
            return gguf.download_model(model_config)
        return super().download_model(model_config)

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        gguf = self.gguf_loader(model_config)
        if gguf is not None:
            return gguf.load_weights(model, model_config)
        return super().load_weights(model, model_config)

    def hf_config(self, model_config: ModelConfig) -> Any:
        gguf = self.gguf_loader(model_config)
        return None if gguf is None else gguf.hf_config(model_config)

    def generation_config(self, model_config: ModelConfig) -> dict[str, Any] | None:
        gguf = self.gguf_loader(model_config)
        return None if gguf is None else gguf.generation_config(model_config)

    def load_tokenizer(self, model_config: ModelConfig, **kwargs: Any) -> Any:
        gguf = self.gguf_loader(model_config)
        return None if gguf is None else gguf.load_tokenizer(model_config, **kwargs)

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
