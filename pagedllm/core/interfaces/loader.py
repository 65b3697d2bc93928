"""The ModelLoader extension point: where weights come from (``--load-format``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pagedllm.core.config import LoadConfig, ModelConfig


class ModelLoader(ABC):
    """Reads a checkpoint format into a model built by pagedllm.

    Contract:
    - ``__init__`` receives the :class:`LoadConfig` (``--download-dir``,
      ``--ignore-patterns``, ``--model-loader-extra-config``, ...) and must refuse keys of
      ``model_loader_extra_config`` it does not understand.
    - :meth:`download_model` makes sure the files are on local disk. No network is
      assumed: a model that is neither a local path nor in the local cache is a clear
      error, never a hang.
    - :meth:`load_weights` fills every parameter of ``model``; a checkpoint tensor the
      model does not know, or a parameter left unfilled, is an error naming it.
    """

    # The quantization method whose checkpoints this format is made for (None: any);
    # the engine refuses it for a model without that method.
    quantization: ClassVar[str | None] = None

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config: ModelConfig) -> None:
        """Ensure the checkpoint for ``model_config`` is available locally."""

    @abstractmethod
    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        """Load the checkpoint's tensors into ``model`` (a ``torch.nn.Module``)."""

    def hf_config(self, model_config: ModelConfig) -> Any:
        """The model config the checkpoint itself carries (a ``transformers``
        ``PretrainedConfig``), or ``None`` to read ``config.json`` as usual. Formats such
        as GGUF that embed their config override this."""
        return None

    def generation_config(self, model_config: ModelConfig) -> dict[str, Any] | None:
        """The generation settings the checkpoint itself recommends, in
        ``generation_config.json``'s names (``temperature``, ``top_p``, ...), or ``None``.
        A ``generation_config.json`` beside the checkpoint takes precedence over them."""
        return None

    def load_tokenizer(self, model_config: ModelConfig, **kwargs: Any) -> Any:
        """The tokenizer the checkpoint itself carries, or ``None`` to load it from the
        model directory as usual. ``kwargs`` are ``AutoTokenizer.from_pretrained`` ones."""
        return None
