"""The model and its weights: :class:`ModelConfig` and :class:`LoadConfig`."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from pagedllm.core.configs.base import Config, require, setting
from pagedllm.core.default_model import DEFAULT_MODEL

# A host name or an IP address literal (--allowed-media-domains).
_DOMAIN = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?\.?|\[[0-9A-Fa-f:.]+\]")


@dataclasses.dataclass
class ModelConfig(Config):
    model: str = DEFAULT_MODEL
    # The model's own tokenizer when unset.
    tokenizer: str | None = None
    tokenizer_mode: str = setting("auto", choices=("auto", "custom", "mistral", "slow"))
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    dtype: str = setting(
        "auto", choices=("auto", "bfloat16", "float", "float16", "float32", "half")
    )
    seed: int | None = setting(None, min=-(2**63), max=2**63 - 1, range_hint="must fit in 64 bits")
    max_model_len: int | None = setting(None, min=1)
    hf_config_path: str | None = None
    # A dict of config attributes, or (from Python) a callable that edits the config.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = dataclasses.field(default_factory=dict)
    rope_scaling: dict[str, Any] = dataclasses.field(default_factory=dict)
    rope_theta: float | None = None
    # [model] when unset; one name is taken as a list of one.
    served_model_name: list[str] | None = None
    task: str = setting(
        "auto",
        choices=(
            "auto",
            "classify",
            "draft",
            "embed",
            "embedding",
            "generate",
            "reward",
            "score",
            "transcription",
        ),
    )
    skip_tokenizer_init: bool = False
    max_logprobs: int = setting(20, min=-1, range_hint="must be >= 0, or -1 for no limit")
    disable_sliding_window: bool = False
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    logits_processor_pattern: str | None = None
    config_format: str = setting("auto", choices=("auto", "hf", "mistral"))
    enforce_eager: bool = False
    # --batch-invariant (or PAGEDLLM_BATCH_INVARIANT / VLLM_BATCH_INVARIANT=1).
    batch_invariant: bool = False
    # --enable-sleep-mode: the engine may release its weights and KV cache while asleep.
    enable_sleep_mode: bool = False
    quantization: str | None = None
    model_impl: str = setting("auto", choices=("auto", "vllm", "pagedllm", "transformers"))
    runner: str = setting("auto", choices=("auto", "generate", "pooling"))
    convert: str = setting("auto", choices=("auto", "none", "embed", "classify", "reward"))
    override_pooler_config: dict[str, Any] | None = None
    # Where requests may read images from (file:// URLs); empty: nowhere.
    allowed_local_media_path: str = ""
    # The only hosts (and their subdomains) image URLs may name; None: any.
    allowed_media_domains: list[str] | None = None

    def check(self) -> None:
        from pagedllm.core.sampling.defaults import check_generation_override

        if not self.tokenizer:
            self.tokenizer = self.model
        served = self.served_model_name
        if served is None:
            names = [self.model]
        elif isinstance(served, str):
            names = [served]
        else:
            names = list(served)
        require(
            bool(names) and all(names), "--served-model-name", served, "names must be non-empty"
        )
        self.served_model_name = names
        check_generation_override(self.override_generation_config)
        self._check_media_options()

    def _check_media_options(self) -> None:
        path = self.allowed_local_media_path
        require(
            not path or os.path.isdir(path),
            "--allowed-local-media-path",
            path,
            "not an existing directory",
        )
        domains = self.allowed_media_domains
        if domains is None:
            return
        if isinstance(domains, str):
            domains = [domains]
        for domain in domains:
            require(
                isinstance(domain, str) and bool(_DOMAIN.fullmatch(domain)),
                "--allowed-media-domains",
                domains,
                f"{domain!r} is not a host name (give names such as example.com, without a "
                "scheme, port or path)",
            )
        self.allowed_media_domains = [d.lower().rstrip(".") for d in domains]


@dataclasses.dataclass
class LoadConfig(Config):
    load_format: str = "auto"
    download_dir: str | None = None
    # Skipped when --ignore-patterns is unset: the extra copies some repositories ship.
    ignore_patterns: list[str] = dataclasses.field(default_factory=lambda: ["original/**/*"])
    model_loader_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    use_tqdm_on_load: bool = True
    qlora_adapter_name_or_path: str | None = None

    def check(self) -> None:
        if isinstance(self.ignore_patterns, str):
            self.ignore_patterns = [self.ignore_patterns]
