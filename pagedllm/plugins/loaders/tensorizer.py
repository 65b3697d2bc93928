"""``tensorizer``: weights from one file written by CoreWeave's tensorizer
(``pip install tensorizer``), read back with its fast, multi-threaded deserializer.

The file holds the checkpoint's tensors under their checkpoint names, as the ``auto``
load format reads them from the model directory, so loading goes through the model's
own ``load_weights`` and quantization works as with the original checkpoint. The model
directory (``--model``) still supplies ``config.json`` and the tokenizer.

Write the file once::

    python -m pagedllm.plugins.loaders.tensorizer serialize --model DIR \\
        --tensorizer-uri DIR/model.tensors [--encryption-keyfile KEY]

(or :func:`serialize` from Python), then load with::

    pagedllm serve DIR --load-format tensorizer \\
        --model-loader-extra-config '{"tensorizer_uri": "DIR/model.tensors"}'

``--model-loader-extra-config`` keys (vLLM's names): ``tensorizer_uri`` (a path, or an
``s3://`` / ``http(s)://`` URI tensorizer opens), ``tensorizer_dir`` (a directory
holding ``model.tensors``; with neither, ``--model``'s own ``model.tensors`` is used),
``num_readers`` (reader threads; default tensorizer's choice), ``verify_hash`` (check
each tensor's stored hash), ``encryption_keyfile`` (the key the file was encrypted
with, written by ``serialize --encryption-keyfile``) and ``s3_access_key_id``,
``s3_secret_access_key``, ``s3_endpoint`` (for ``s3://``; else tensorizer reads
``~/.s3cfg``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.base import FileLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager

INSTALL_HINT = "pip install tensorizer"
DEFAULT_FILE = "model.tensors"
_S3_KEYS = ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
# Load formats whose tensors are the checkpoint's, by name (what serialize writes).
_SOURCE_FORMATS = ("auto", "safetensors", "pt", "npcache", "runai_streamer")


def _tensorizer() -> Any:
    try:
        import tensorizer
        import tensorizer.stream_io
    except ImportError as exc:
        raise ConfigError(
            f"the tensorizer load format needs CoreWeave's tensorizer ('{INSTALL_HINT}'): {exc}"
        ) from exc
    return tensorizer


def _is_remote(uri: str) -> bool:
    return uri.startswith(("s3://", "http://", "https://"))


def _read_key(keyfile: str, s3: dict[str, Any]) -> bytes:
    stream_io = _tensorizer().stream_io
    try:
        with stream_io.open_stream(keyfile, "rb", **s3) as stream:
            return stream.read()
    except OSError as exc:
        raise ConfigError(f"encryption_keyfile {keyfile}: cannot read it: {exc}") from exc


class TensorizerLoader(FileLoader):
    extra_config_keys = frozenset(
        {"tensorizer_uri", "tensorizer_dir", "num_readers", "verify_hash", "encryption_keyfile"}
        | set(_S3_KEYS)
    )

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        for key in ("tensorizer_uri", "tensorizer_dir", "encryption_keyfile", *_S3_KEYS):
            if key in extra and not isinstance(extra[key], str | os.PathLike):
                raise ConfigError(
                    f"--model-loader-extra-config: {key} must be a string, got {extra[key]!r}"
                )
        if "tensorizer_uri" in extra and "tensorizer_dir" in extra:
            raise ConfigError(
                "--model-loader-extra-config: give tensorizer_uri (the file) or "
                "tensorizer_dir (the directory holding model.tensors), not both"
            )
        readers = extra.get("num_readers")
        if readers is not None and (
            isinstance(readers, bool) or not isinstance(readers, int) or readers < 1
        ):
            raise ConfigError(
                f"--model-loader-extra-config: num_readers must be a positive integer, got "
                f"{readers!r}"
            )
        if not isinstance(extra.get("verify_hash", False), bool):
            raise ConfigError(
                f"--model-loader-extra-config: verify_hash must be true or false, got "
                f"{extra['verify_hash']!r}"
            )
        self.num_readers: int | None = readers
        self.verify_hash: bool = extra.get("verify_hash", False)
        self.encryption_keyfile: str | None = extra.get("encryption_keyfile")
        self.s3 = {key: str(extra[key]) for key in _S3_KEYS if key in extra}

    def tensorizer_uri(self, model_config: ModelConfig) -> str:
        """``tensorizer_uri``, else ``tensorizer_dir/model.tensors``, else the model
        directory's ``model.tensors``."""
        extra = self.load_config.model_loader_extra_config
        if "tensorizer_uri" in extra:
            return str(extra["tensorizer_uri"])
        if "tensorizer_dir" in extra:
            return f"{str(extra['tensorizer_dir']).rstrip('/')}/{DEFAULT_FILE}"
        file = self.model_dir(model_config) / DEFAULT_FILE
        if not file.is_file():
            raise ConfigError(
                "--load-format tensorizer: say which file to read with "
                '--model-loader-extra-config \'{"tensorizer_uri": "PATH/model.tensors"}\' '
                f"(or tensorizer_dir); {self.model_dir(model_config)} has no {DEFAULT_FILE} "
                "(write one with: python -m pagedllm.plugins.loaders.tensorizer serialize)"
            )
        return str(file)

    def weight_files(self, model_config: ModelConfig) -> list[Path]:
        """The local file to read (none for a remote URI, which is streamed)."""
        uri = self.tensorizer_uri(model_config)
        if _is_remote(uri):
            return []
        if not Path(uri).is_file():
            raise ConfigError(f"--load-format tensorizer: {uri}: no such file")
        return [Path(uri)]

    def download_model(self, model_config: ModelConfig) -> None:
        _tensorizer()
        self.weight_files(model_config)

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        return self._read(self.tensorizer_uri(model_config))

    def read_file(self, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        return self._read(str(file))

    def _read(self, uri: str) -> Iterator[tuple[str, torch.Tensor]]:
        tensorizer = _tensorizer()
        encryption = None
        if self.encryption_keyfile is not None:
            key = _read_key(self.encryption_keyfile, self.s3)
            encryption = tensorizer.DecryptionParams.from_key(key)
        try:
            with tensorizer.stream_io.open_stream(uri, "rb", **self.s3) as stream:
                deserializer = tensorizer.TensorDeserializer(
                    stream,
                    device="cpu",
                    lazy_load=True,
                    num_readers=self.num_readers,
                    verify_hash=self.verify_hash,
                    encryption=encryption,
                )
                try:
                    for name in deserializer.keys():
                        yield name, deserializer[name]
                finally:
                    deserializer.close()
        except (
            OSError,
            ValueError,
            tensorizer.CryptographyError,
            tensorizer.serialization.HashMismatchError,
        ) as exc:
            hint = ""
            if isinstance(exc, tensorizer.CryptographyError):
                hint = " (is encryption_keyfile the key it was written with?)"
            raise ConfigError(f"tensorizer cannot read {uri}{hint}: {exc}") from exc


def serialize(
    model: str | os.PathLike | EngineArgs,
    tensorizer_uri: str,
    *,
    encryption_keyfile: str | None = None,
    plugin_manager: PluginManager | None = None,
) -> None:
    """Write the checkpoint of ``model`` (a model directory, or the engine arguments
    whose ``--model``, ``--revision``, ``--download-dir`` and ``--load-format`` say how to
    read it) to ``tensorizer_uri`` for ``--load-format tensorizer``. With
    ``encryption_keyfile``, the tensors are encrypted with a new random key written to
    that file (pass it as the ``encryption_keyfile`` extra-config key to load)."""
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.loading import get_model_loader
    from pagedllm.core.plugins import make_plugin_manager
    from pagedllm.plugins.loaders.default import AutoLoader

    tensorizer = _tensorizer()
    engine_args = model if isinstance(model, EngineArgs) else EngineArgs(model=os.fspath(model))
    pm = plugin_manager or make_plugin_manager()
    config = engine_args.create_engine_config(pm)
    mc, load_config = config.model_config, config.load_config
    if load_config.load_format not in _SOURCE_FORMATS:
        raise ConfigError(
            f"tensorizer serialize: --load-format {load_config.load_format} does not give "
            f"the checkpoint's tensors by name; read the checkpoint with one of "
            f"{', '.join(_SOURCE_FORMATS)}"
        )
    loader = get_model_loader(load_config, pm)
    if isinstance(loader, AutoLoader) and loader.gguf_loader(mc) is not None:
        raise ConfigError(
            f"tensorizer serialize: {mc.model!r} is a GGUF checkpoint, which keeps its own "
            "quantized layout; serialize a safetensors or PyTorch checkpoint"
        )
    assert isinstance(loader, FileLoader)
    loader.download_model(mc)
    if not _is_remote(tensorizer_uri):
        Path(tensorizer_uri).parent.mkdir(parents=True, exist_ok=True)
    encryption = None
    if encryption_keyfile is not None:
        encryption = tensorizer.EncryptionParams.random()
        with tensorizer.stream_io.open_stream(encryption_keyfile, "wb+") as stream:
            stream.write(encryption.key)
    weights = dict(loader.iter_weights(mc))
    with tensorizer.stream_io.open_stream(tensorizer_uri, "wb+") as stream:
        serializer = tensorizer.TensorSerializer(stream, encryption=encryption)
        serializer.write_state_dict(weights)
        serializer.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedllm.plugins.loaders.tensorizer serialize --model DIR
    --tensorizer-uri FILE [--encryption-keyfile KEY] [engine options]``."""
    from pagedllm.core.argparser import FlexibleArgumentParser
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import make_plugin_manager

    pm = make_plugin_manager()
    parser = FlexibleArgumentParser(
        prog="python -m pagedllm.plugins.loaders.tensorizer",
        description="Write a model's checkpoint as one tensorizer file, for "
        "--load-format tensorizer.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = subparsers.add_parser(
        "serialize",
        help="write the tensors of --model to --tensorizer-uri",
        description="Write the tensors of --model (read as --load-format reads them) to "
        "--tensorizer-uri. Load them with: --load-format tensorizer "
        "--model-loader-extra-config '{\"tensorizer_uri\": URI}'.",
    )
    sub.add_argument("--tensorizer-uri", required=True, help="the file (or s3:// URI) to write")
    sub.add_argument(
        "--encryption-keyfile",
        default=None,
        help="encrypt the tensors with a new random key written to this file",
    )
    EngineArgs.add_cli_args(sub, pm)
    args = parser.parse_args(argv)
    try:
        serialize(
            EngineArgs.from_cli_args(args),
            args.tensorizer_uri,
            encryption_keyfile=args.encryption_keyfile,
            plugin_manager=pm,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.tensorizer_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
