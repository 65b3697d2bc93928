"""What the engine knows of image inputs: which models take them. An image's content
hash (the key its processed form and its prompt tokens are cached under) is
:func:`pagedllm.core.interfaces.multimodal.content_hash`.

The loading of images (data URLs, files, http) is the entry points' concern
(:mod:`pagedllm.entrypoints.media`); here images are already decoded PIL images.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager


def model_accepts_images(hf_config: Any, pm: PluginManager | None = None) -> bool:
    """Whether a model of ``hf_config`` takes image inputs: a multimodal processor is
    registered (in ``pm``'s registry, the engine's; else the installed plugins') for one of
    its architectures, as the engine turns them on."""
    if pm is None:
        from pagedllm.core.plugins import make_plugin_manager

        pm = make_plugin_manager()
    names = set(pm.registry("multimodal_processors").names())
    return any(a in names for a in getattr(hf_config, "architectures", None) or ())
