"""``sharded_state``: each rank's parameters saved as they are in the built model, in
``model-rank-{rank}-part-{part}.safetensors`` files (vLLM's ShardedStateLoader layout;
``--model-loader-extra-config '{"pattern": ...}'`` names them otherwise).

The files hold the model's own parameters by their own names and in their own layout
(after the model renamed and rearranged the checkpoint's tensors, before any
quantization method or the model repacked them), so loading copies each into the
parameter of that name, with no conversion, and then the usual processing runs.

With tensor parallelism (and pipeline stages) each rank saves and loads its own part:
``{rank}`` is the process's global rank (stage x --tensor-parallel-size + its
tensor-parallel rank; the tensor-parallel rank without stages, as vLLM's), its files
hold its shards as they are, and a state loads with the parallel sizes it was saved
with.

Save them from a running model with ``LLM.save_sharded_state(path)``, or::

    python -m pagedllm.plugins.loaders.sharded_state --model DIR --output OUT \\
        [--max-file-size BYTES] [engine options such as --dtype, --quantization]

which also copies the model directory's other files (config, tokenizer, generation
config), so that ``pagedllm serve OUT --load-format sharded_state`` runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.base import FileLoader, check_all_loaded

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig, PagedLLMConfig
    from pagedllm.core.plugins import PluginManager

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
# Files of a model directory that hold weights, not copied beside the saved shards.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors", ".npy", ".ckpt"}
# An fp8 KV cache's scales, which the checkpoint gives and attention layers keep as
# attributes, saved as ``<attention>.checkpoint_k_scale`` / ``checkpoint_v_scale``.
_KV_SCALE = re.compile(r"(.+)\.(checkpoint_[kv]_scale)")


def this_rank() -> int:
    """This process's rank among the model's (the ``{rank}`` of its files)."""
    from pagedllm.distributed.parallel_state import pipeline_parallel, tp_rank, tp_size

    return pipeline_parallel().rank * tp_size() + tp_rank()


def _file_name(pattern: str, part: int | str, rank: int | str | None = None) -> str:
    rank = this_rank() if rank is None else rank
    try:
        name = pattern.format(rank=rank, part=part)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"sharded_state pattern {pattern!r}: only {{rank}} and {{part}} may be filled "
            f"in ({exc!r})"
        ) from None
    if "/" in name or os.sep in name or not name:
        raise ConfigError(f"sharded_state pattern {pattern!r}: must be a file name")
    return name


def _check_max_size(max_size: int | None) -> None:
    if max_size is not None and (isinstance(max_size, bool) or max_size <= 0):
        raise ConfigError(f"sharded_state max_size must be a positive number of bytes: {max_size}")


class ShardedStateLoader(FileLoader):
    """Reads this rank's ``pattern`` files from the model directory."""

    extra_config_keys = frozenset({"pattern"})

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        pattern = load_config.model_loader_extra_config.get("pattern", DEFAULT_PATTERN)
        if not isinstance(pattern, str):
            raise ConfigError(
                f"--model-loader-extra-config: pattern must be a string, got {pattern!r}"
            )
        self.pattern = pattern
        self.patterns = (_file_name(pattern, "*"),)

    def weight_files(self, model_config: ModelConfig) -> list[Path]:
        try:
            return super().weight_files(model_config)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc}. --load-format sharded_state reads the files LLM.save_sharded_state() "
                "or 'python -m pagedllm.plugins.loaders.sharded_state' writes"
            ) from None

    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        from pagedllm.core.attention.layer import Attention
        from pagedllm.core.layers.weights import copy_weights

        attentions = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}
        seen: set[str] = set()

        def parameters() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.iter_weights(model_config):
                if name in seen:
                    raise ConfigError(f"the sharded state has {name!r} in more than one file")
                seen.add(name)
                scale = _KV_SCALE.fullmatch(name)
                if scale and scale.group(1) in attentions:
                    setattr(attentions[scale.group(1)], scale.group(2), float(tensor))
                else:
                    yield name, tensor

        try:
            # (this rank's own shards, as they are: no tensor-parallel narrowing)
            check_all_loaded(model, copy_weights(model, parameters(), shards=False))
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (a sharded state loads with the --tensor-parallel-size and "
                "--pipeline-parallel-size it was saved with)"
            ) from None


def model_state(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sharded state holds: the parameters, and the KV-cache scales the
    checkpoint gave the attention layers."""
    import torch

    yield from model.named_parameters()
    for name, module in model.named_modules():
        for attribute in ("checkpoint_k_scale", "checkpoint_v_scale"):
            value = getattr(module, attribute, None)
            if value is not None:
                yield f"{name}.{attribute}", torch.tensor(float(value))


def write_shards(
    state: Iterable[tuple[str, torch.Tensor]],
    directory: Path,
    pattern: str = DEFAULT_PATTERN,
    max_size: int | None = None,
) -> list[Path]:
    """``state`` in ``pattern`` files of at most ``max_size`` bytes each (a tensor larger
    than that alone in its file), in order; the files written."""
    from safetensors.torch import save_file

    _check_max_size(max_size)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state:
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and max_size is not None and size + nbytes > max_size:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    if len(parts) > 1 and _file_name(pattern, 0) == _file_name(pattern, 1):
        raise ConfigError(f"sharded_state pattern {pattern!r} needs {{part}} for several files")
    files = []
    for number, part in enumerate(parts):
        # Copies, one file's at a time: fused layers' parameters are views of one tensor,
        # which safetensors does not store twice; and files are written from the CPU.
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in part.items()}
        files.append(directory / _file_name(pattern, number))
        save_file(tensors, files[-1], metadata={"format": "pt"})
    return files


def save_sharded_state(
    config: PagedLLMConfig,
    pm: PluginManager,
    path: str | os.PathLike,
    pattern: str | None = None,
    max_size: int | None = None,
) -> list[Path]:
    """Build the model of ``config`` afresh (its weights loaded, not processed), write
    its state to ``path`` as ``pattern`` files of at most ``max_size`` bytes (one file
    when None), and copy the model directory's other files (config, tokenizer,
    generation config; not its weights) beside them. The files written. (With several
    ranks, ``LLM.save_sharded_state`` runs these steps over them.)"""
    output = check_output(config, pm, path, pattern, max_size)
    files = save_rank_state(config, pm, output, pattern, max_size)
    copy_model_files(config, output)
    return files


def copy_model_files(config: PagedLLMConfig, output: Path) -> None:
    """The model directory's files but its weights (config, tokenizer, generation
    config), copied into ``output``."""
    for file in sorted(_model_directory(config).iterdir()):
        if (
            file.is_file()
            and file.suffix not in _WEIGHT_SUFFIXES
            and not file.name.endswith(".index.json")
        ):
            shutil.copy2(file, output / file.name)


def save_rank_state(
    config: PagedLLMConfig,
    pm: PluginManager,
    output: Path,
    pattern: str | None = None,
    max_size: int | None = None,
) -> list[Path]:
    """This rank's part of a sharded state: the model (its shard, its stage) built
    afresh, its state written as ``pattern`` files of this rank."""
    import torch

    from pagedllm.core.model_setup import build_model

    threads = torch.get_num_threads()  # (building sets the device's; this rank has a share)
    try:
        built = build_model(config, pm)
    finally:
        torch.set_num_threads(threads)
    return write_shards(model_state(built.model), output, pattern or DEFAULT_PATTERN, max_size)


def _model_directory(config: PagedLLMConfig) -> Path:
    from pagedllm.core.model_files import resolve_model_path

    mc = config.model_config
    source = resolve_model_path(
        mc.model, revision=mc.revision, download_dir=config.load_config.download_dir
    )
    return source if source.is_dir() else source.parent


def check_output(
    config: PagedLLMConfig,
    pm: PluginManager,
    path: str | os.PathLike,
    pattern: str | None,
    max_size: int | None,
    ranks: int = 1,
) -> Path:
    """The output directory of a sharded state (made), checked: not the model's, no
    shard files of any of the ``ranks`` there already."""
    from pagedllm.core.loading import get_model_loader

    mc = config.model_config
    pattern = pattern or DEFAULT_PATTERN
    _file_name(pattern, 0)
    _check_max_size(max_size)
    if get_model_loader(config.load_config, pm).hf_config(mc) is not None:
        raise ConfigError(
            f"save_sharded_state: {mc.model!r} carries its config inside its weights file "
            "(GGUF), which a sharded state cannot; save a safetensors or PyTorch checkpoint"
        )
    source = _model_directory(config)
    output = Path(path)
    if output.exists() and output.resolve() == source.resolve():
        raise ConfigError(
            f"save_sharded_state: the output {output} is the model directory; its shard "
            "files would sit beside the checkpoint's own safetensors"
        )
    output.mkdir(parents=True, exist_ok=True)
    stale = sorted(
        f.name for rank in range(ranks) for f in output.glob(_file_name(pattern, "*", rank))
    )
    if stale:
        raise ConfigError(
            f"save_sharded_state: {output} already holds shard files {stale[:4]}; remove "
            "them or choose another directory"
        )
    return output


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedllm.plugins.loaders.sharded_state --model DIR --output OUT
    [--file-pattern P] [--max-file-size BYTES] [engine options]``."""
    from pagedllm.core.argparser import FlexibleArgumentParser
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import make_plugin_manager

    pm = make_plugin_manager()
    parser = FlexibleArgumentParser(
        prog="python -m pagedllm.plugins.loaders.sharded_state",
        description="Save a model's parameters as sharded-state files (and copy its config "
        "and tokenizer), to load with: pagedllm serve OUT --load-format sharded_state.",
    )
    parser.add_argument("-o", "--output", required=True, help="directory to write")
    parser.add_argument(
        "--file-pattern",
        default=None,
        help=f"file names, with {{rank}} and {{part}} (default {DEFAULT_PATTERN!r})",
    )
    parser.add_argument(
        "--max-file-size",
        "--max-size",
        type=int,
        default=5 * 1024**3,
        help="bytes per file at most (default 5 GiB)",
    )
    EngineArgs.add_cli_args(parser, pm)
    args = parser.parse_args(argv)
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config(pm)
        files = save_sharded_state(
            config, pm, args.output, pattern=args.file_pattern, max_size=args.max_file_size
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} file(s) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
