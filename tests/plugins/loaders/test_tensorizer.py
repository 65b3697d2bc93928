"""``--load-format tensorizer``: a tiny Llama's checkpoint written to one file with
CoreWeave's ``tensorizer`` (by ``serialize`` and by its command line), read back with
the model directory's config and tokenizer, runs as transformers runs the original,
token for token; encrypted files need their key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM, EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.tensorizer import serialize

PROMPTS = [[1, 5, 9, 23, 42, 77, 3, 18], [1, 7, 7, 7, 3, 100, 12]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tensorizer") / "llama", "llama", seed=6)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def tensorizer_llm(model_dir, **extra):
    return LLM(
        str(model_dir),
        load_format="tensorizer",
        model_loader_extra_config=extra,
        dtype="float32",
        disable_log_stats=True,
    )


def test_serialized_model_matches_transformers(model_dir, reference, tmp_path):
    uri = tmp_path / "out" / "model.tensors"
    serialize(model_dir, str(uri))
    llm = tensorizer_llm(model_dir, tensorizer_uri=str(uri), num_readers=2, verify_hash=True)
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)
    # tensorizer_dir names the directory holding model.tensors.
    llm = tensorizer_llm(model_dir, tensorizer_dir=str(uri.parent))
    assert_matches_reference(llm, reference, PROMPTS[:1], NEW_TOKENS, tolerance=1e-3)
    # A changed byte in a tensor's data fails the hash check.
    data = bytearray(uri.read_bytes())
    norm = load_file(model_dir / "model.safetensors")["model.norm.weight"]
    data[data.find(norm.numpy().tobytes()) + 5] ^= 0x40
    uri.write_bytes(bytes(data))
    with pytest.raises(
        ConfigError, match=r"tensorizer cannot read .*model.tensors: Tensor .* failed"
    ):
        tensorizer_llm(model_dir, tensorizer_uri=str(uri), verify_hash=True)


def test_command_line_and_encryption(model_dir, reference, tmp_path):
    uri, key = tmp_path / "model.tensors", tmp_path / "model.key"
    command = [
        sys.executable,
        "-m",
        "pagedllm.plugins.loaders.tensorizer",
        "serialize",
        "--model",
        str(model_dir),
        "--tensorizer-uri",
        str(uri),
        "--encryption-keyfile",
        str(key),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert uri.is_file() and len(key.read_bytes()) == 32
    llm = tensorizer_llm(model_dir, tensorizer_uri=str(uri), encryption_keyfile=str(key))
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)
    with pytest.raises(ConfigError, match="encrypted, but decryption was not requested"):
        tensorizer_llm(model_dir, tensorizer_uri=str(uri))
    other = tmp_path / "other.key"
    other.write_bytes(bytes(32))
    with pytest.raises(ConfigError, match="is encryption_keyfile the key"):
        tensorizer_llm(model_dir, tensorizer_uri=str(uri), encryption_keyfile=str(other))


def test_model_directory_file_used_without_uri(model_dir, reference, tmp_path):
    directory = tmp_path / "with_tensors"
    directory.mkdir()
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":  # only config and tokenizer
            (directory / file.name).write_bytes(file.read_bytes())
    with pytest.raises(ConfigError, match=r"tensorizer_uri.*has no model\.tensors"):
        tensorizer_llm(directory)
    serialize(
        EngineArgs(model=str(model_dir), load_format="safetensors"),
        str(directory / "model.tensors"),
    )
    assert_matches_reference(tensorizer_llm(directory), reference, PROMPTS[:1], NEW_TOKENS, 1e-3)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tensorizer_uri": "/nonexistent/model.tensors"}, "no such file"),
        ({"tensorizer_uri": "a", "tensorizer_dir": "b"}, "not both"),
        ({"tensorizer_uri": "a", "num_readers": 0}, "num_readers must be a positive integer"),
        ({"tensorizer_uri": "a", "plaid_mode": True}, r"unknown key\(s\) \['plaid_mode'\]"),
    ],
)
def test_bad_extra_config_refused(model_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        tensorizer_llm(model_dir, **extra)


def test_serialize_refuses_formats_without_checkpoint_names(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="--load-format dummy does not give"):
        serialize(EngineArgs(model=str(model_dir), load_format="dummy"), str(tmp_path / "x"))
