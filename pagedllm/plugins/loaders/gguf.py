"""The ``gguf`` load format: a llama.cpp GGUF file.

The file carries its own config (``<arch>.*`` metadata) and tokenizer
(``tokenizer.ggml.*``), so no Hugging Face files are needed next to it. Its weights stay
packed (the ``gguf`` quantization method computes with them), unless
``--model-loader-extra-config '{"dequantize": true}'`` asks for float weights (faster on
some machines, several times the memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelLoader
from pagedllm.core.model_files import cache_dir, resolve_model_path
from pagedllm.plugins.loaders.base import check_all_loaded
from pagedllm.plugins.loaders.gguf_arch import ARCHITECTURES, GGUFArchitecture
from pagedllm.plugins.loaders.gguf_file import GGUFFile, find_gguf_file

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig


logger = logging.getLogger("pagedllm.loaders.gguf")

# llama.cpp's recommended-sampler metadata keys -> the generation-config names.
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def reverse_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (``n_head`` is the
    number of KV heads for K): rows ``(n_head, 2, d/2)`` were stored as ``(n_head, d/2, 2)``.
    Works on packed rows too: quantization blocks never cross rows."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _tokenizer_cache(path: Path) -> Path:
    """Where the tokenizer converted from a GGUF file's metadata is kept (a converted
    tokenizer loads from its ``tokenizer.json`` in a fraction of the conversion's time):
    keyed by the file's path, size and modification time, the transformers version (read
    from its metadata: importing transformers is what the cache saves) and the form the
    cache is written in (``_CACHE_FORMAT``)."""
    from importlib.metadata import version

    stat = path.stat()
    identity = (
        f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('transformers')}"
        f"|{_CACHE_FORMAT}"
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return cache_dir("tokenizers") / f"{path.stem}-{key}"


# 2: BPE merges saved as "a b" strings (see _merges_as_strings).
_CACHE_FORMAT = 2


def _merges_as_strings(json_file: Path) -> None:
    """Rewrite the BPE merges of a saved ``tokenizer.json`` from ``["a", "b"]`` pairs to
    ``"a b"`` strings, the other form ``tokenizers`` reads: the same merges, read in about
    two thirds of the time (20 ms of every start of the default model). Left as they are
    where a merged piece holds a space, which the string form cannot tell apart."""
    data = json.loads(json_file.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not isinstance(merges, list):
        return
    if not all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and " " not in p for p in m)
        for m in merges
    ):
        return
    model["merges"] = [f"{a} {b}" for a, b in merges]
    json_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _save_tokenizer(tokenizer: Any, target: Path) -> None:
    """Save into ``target`` whole or not at all (concurrent starts each write their own
    temporary directory; the first rename wins). A cache that cannot be written is
    skipped: the next start converts again."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # (Once renamed, the temporary directory is gone: nothing for its clean-up.)
        with tempfile.TemporaryDirectory(dir=target.parent, ignore_cleanup_errors=True) as tmp:
            tokenizer.save_pretrained(tmp)
            _merges_as_strings(Path(tmp) / "tokenizer.json")
            # A start that finds target already there (OSError) leaves its copy to the
            # clean-up.
            with contextlib.suppress(OSError):
                os.rename(tmp, target)
    except OSError as exc:
        logger.debug("could not cache the converted tokenizer in %s: %s", target, exc)


def _tokenizer_class() -> Any:
    try:
        # The class AutoTokenizer picks for a GGUF file, without the seconds its
        # full-metadata parse (to find the model type) costs.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    except ImportError:  # older transformers
        from transformers import AutoTokenizer

        return AutoTokenizer


def gguf_path_of(model: str, download_dir: str | None = None) -> Path | None:
    """The GGUF file a ``--model`` value names (a ``.gguf`` path, or a directory holding
    exactly one), or ``None``."""
    try:
        path = resolve_model_path(model, download_dir=download_dir)
    except ConfigError:
        return None
    return find_gguf_file(path)


class GGUFLoader(ModelLoader):
    """Weights, config and tokenizer from one GGUF file."""

    EXTRA_CONFIG_KEYS = ("dequantize",)

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        unknown = set(extra) - set(self.EXTRA_CONFIG_KEYS)
        if unknown:
            raise ConfigError(
                f"--model-loader-extra-config: unknown key(s) {sorted(unknown)} for load "
                f"format 'gguf' (accepted: {', '.join(self.EXTRA_CONFIG_KEYS)})"
            )
        dequantize = extra.get("dequantize", False)
        if not isinstance(dequantize, bool):
            raise ConfigError(
                f"--model-loader-extra-config: 'dequantize' must be true or false, got "
                f"{dequantize!r}"
            )
        self.dequantize = dequantize
        self._files: dict[Path, GGUFFile] = {}

    def gguf_file(self, model_config: ModelConfig) -> GGUFFile:
        path = resolve_model_path(
            model_config.model,
            revision=model_config.revision,
            download_dir=self.load_config.download_dir,
        )
        file = find_gguf_file(path)
        if file is None:
            raise ConfigError(
                f"load format 'gguf': {model_config.model!r} is neither a .gguf file nor a "
                f"directory holding one"
            )
        if file not in self._files:
            gguf = GGUFFile(file)
            if gguf.architecture not in ARCHITECTURES:
                raise ConfigError(
                    f"{file.name}: GGUF architecture {gguf.architecture!r} is not supported; "
                    f"supported: {', '.join(ARCHITECTURES)}"
                )
            self._files[file] = gguf
        return self._files[file]

    def _architecture(self, gguf: GGUFFile) -> GGUFArchitecture:
        return ARCHITECTURES[gguf.architecture]

    def download_model(self, model_config: ModelConfig) -> None:
        self.gguf_file(model_config)

    def hf_config(self, model_config: ModelConfig) -> Any:
        gguf = self.gguf_file(model_config)
        arch = self._architecture(gguf)
        config = arch.config(gguf)
        if self.dequantize:
            if model_config.quantization == "gguf":
                raise ConfigError(
                    "--quantization gguf keeps the weights packed; it cannot be combined "
                    "with --model-loader-extra-config '{\"dequantize\": true}'"
                )
            return config
        packed: dict[str, int] = {}
        for name, info in gguf.tensors.items():
            target = arch.hf_name(name)
            if target is not None and len(info.shape) == 2:
                packed[target] = int(info.qtype)
        config.quantization_config = {"quant_method": "gguf", "tensor_types": packed}
        return config

    def generation_config(self, model_config: ModelConfig) -> dict[str, Any] | None:
        """The sampling settings llama.cpp's converter stores as ``general.sampling.*``
        (from the model's generation_config.json); keys with no vLLM sampling field
        (mirostat, xtc, ...) are left to llama.cpp."""
        metadata = self.gguf_file(model_config).metadata
        found = {}
        for key, name in SAMPLING_KEYS.items():
            value = metadata.get(key)
            if isinstance(value, float):
                value = float(str(np.float32(value)))  # 0.2, not float32's 0.200000003
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[name] = value
        return found or None

    def load_tokenizer(self, model_config: ModelConfig, **kwargs: Any) -> Any:
        """The tokenizer transformers converts from the file's metadata, cached as its
        ``tokenizer.json``; read back with ``tokenizers`` alone
        (:class:`~pagedllm.core.tokenizer.JSONTokenizer`, no transformers import) where
        that reproduces it."""
        from pagedllm.core.tokenizer import load_json_tokenizer

        gguf = self.gguf_file(model_config)
        kwargs.pop("use_fast", None)
        kwargs.pop("trust_remote_code", None)
        kwargs.pop("revision", None)  # a local file has no revisions
        cached = _tokenizer_cache(gguf.path)
        if (cached / "tokenizer.json").is_file():
            light = None if kwargs else load_json_tokenizer(cached)
            if light is not None:
                return light
            try:
                return _tokenizer_class().from_pretrained(cached, **kwargs)
            except (OSError, ValueError) as exc:
                logger.warning("ignoring the cached tokenizer in %s: %s", cached, exc)
        try:
            tokenizer = _tokenizer_class().from_pretrained(
                gguf.path.parent, gguf_file=gguf.path.name, **kwargs
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot build the tokenizer of {gguf.path}: {exc}") from exc
        _save_tokenizer(tokenizer, cached)
        # (The same class a warm start gets, where the cache was written.)
        light = None if kwargs else load_json_tokenizer(cached)
        return light if light is not None else tokenizer

    def iter_weights(
        self, model_config: ModelConfig, packed: set[str] | frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` pairs: uint8 ``[rows, bytes_per_row]`` for the names in
        ``packed``, float32 (the model casts them) for the rest."""
        import torch

        gguf = self.gguf_file(model_config)
        arch = self._architecture(gguf)
        config = getattr(self, "_config", None) or self.hf_config(model_config)
        names = list(gguf.tensors)
        if self.load_config.use_tqdm_on_load:
            from tqdm import tqdm

            names = tqdm(names, desc="Loading GGUF tensors", unit="tensor", leave=False)
        for name in names:
            target = arch.hf_name(name)
            if target is None:
                raise ConfigError(
                    f"{gguf.path.name}: GGUF tensor {name!r} has no place in the "
                    f"{gguf.architecture} model"
                )
            if target in packed:
                tensor = torch.from_numpy(gguf.raw(name))
            else:
                tensor = gguf.dequantized(name)
                if arch.norm_minus_one and name.endswith("norm.weight"):
                    tensor = tensor - 1
            if arch.permute_qk and ".attn_q." in name:
                tensor = reverse_permute(tensor, config.num_attention_heads)
            elif arch.permute_qk and ".attn_k." in name:
                tensor = reverse_permute(tensor, config.num_key_value_heads)
            yield target, tensor

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        import torch

        self._config = getattr(model, "config", None)
        packed = {name for name, param in model.named_parameters() if param.dtype == torch.uint8}
        try:
            loaded = model.load_weights(self.iter_weights(model_config, packed))
        finally:
            # Drop the memory map: what the model keeps was copied out of it.
            self._files.clear()
        check_all_loaded(model, loaded)
