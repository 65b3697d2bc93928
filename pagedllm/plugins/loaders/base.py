"""Shared machinery of the file-based loaders: find files, stream tensors, check coverage."""

from __future__ import annotations

import fnmatch
import json
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelLoader
from pagedllm.core.model_files import resolve_model_path

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig


class FileLoader(ModelLoader):
    """A loader that reads tensors from checkpoint files found in the model directory."""

    # Globs of the weight files, tried in order, and the shard index listing them.
    patterns: tuple[str, ...] = ()
    index_name: str = ""
    extra_config_keys: frozenset[str] = frozenset()

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        unknown = set(load_config.model_loader_extra_config) - self.extra_config_keys
        if unknown:
            raise ConfigError(
                f"--model-loader-extra-config: unknown key(s) {sorted(unknown)} for load "
                f"format {load_config.load_format!r} (accepted: "
                f"{sorted(self.extra_config_keys) or 'none'})"
            )

    def model_dir(self, model_config: ModelConfig) -> Path:
        path = resolve_model_path(
            model_config.model,
            revision=model_config.revision,
            download_dir=self.load_config.download_dir,
        )
        return path if path.is_dir() else path.parent

    def download_model(self, model_config: ModelConfig) -> None:
        self.weight_files(model_config)

    def weight_files(self, model_config: ModelConfig) -> list[Path]:
        directory = self.model_dir(model_config)
        return self.files_in(directory)

    def files_in(self, directory: Path) -> list[Path]:
        index = directory / self.index_name
        if self.index_name and index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = sorted({directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConfigError(f"{index} lists shard(s) that are missing: {missing}")
        else:
            files = []
            for pattern in self.patterns:
                files = [
                    f
                    for f in sorted(directory.glob(pattern))
                    if not self._ignored(f.relative_to(directory))
                ]
                if files:
                    break
        files = [f for f in files if not self._ignored(f.relative_to(directory))]
        if not files:
            raise ConfigError(
                f"no {' or '.join(self.patterns)} weight files in {directory} "
                f"(load format {self.load_config.load_format!r}, ignore patterns "
                f"{self.load_config.ignore_patterns})"
            )
        return files

    def _ignored(self, relative: Path) -> bool:
        text = relative.as_posix()
        return any(fnmatch.fnmatch(text, p) for p in self.load_config.ignore_patterns)

    @abstractmethod
    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs stored in one file."""

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        files = self.weight_files(model_config)
        if self.load_config.use_tqdm_on_load:
            from tqdm import tqdm

            files = tqdm(files, desc="Loading weights", unit="file", leave=False)
        for file in files:
            yield from self.read_file(file)

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        loaded = model.load_weights(self.iter_weights(model_config))
        check_all_loaded(model, loaded)


def check_all_loaded(model: Any, loaded: set[str]) -> None:
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ConfigError(f"the checkpoint has no weights for {len(missing)} parameter(s): {shown}")
