"""Finding a model's files on local disk. pagedllm never downloads at run time."""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.core.default_model import DEFAULT_MODEL, default_model_path
from pagedllm.core.errors import ConfigError

# (defined with the kernels, the lowest layer that needs it: compiled kernels are cached)
from pagedllm.kernels.native import cache_dir as cache_dir


def resolve_model_path(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """A local directory (or file) for ``model``: a path as given, the embedded default
    model, a Hugging Face repository id already in the local cache (``--download-dir`` or
    the HF cache), or ``owner/repo/file.gguf`` naming one GGUF file of such a repository."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model == DEFAULT_MODEL:
        return default_model_path()
    if model.startswith((".", "/", "~")):
        raise ConfigError(f"model path {model!r} does not exist")
    if model.count("/") == 2 and model.endswith(".gguf"):
        repo, file_name = model.rsplit("/", 1)
        snapshot = resolve_model_path(
            repo, revision=revision, download_dir=download_dir, allow_patterns=[file_name]
        )
        if not (snapshot / file_name).is_file():
            raise ConfigError(f"{repo!r} in the local cache has no file {file_name!r}")
        return snapshot / file_name
    if model.count("/") > 1:
        raise ConfigError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            repo_id=model,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=allow_patterns,
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        cache = download_dir or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
        raise ConfigError(
            f"model {model!r} is neither a local path nor in {cache}"
            f"{' at revision ' + revision if revision else ''}; pagedllm does not download "
            f"models: pass a local directory, or fetch it first (e.g. 'hf download "
            f"{model}')"
        ) from exc
    return Path(snapshot)
