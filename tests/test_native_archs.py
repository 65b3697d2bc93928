"""The native architectures added beside the Llama family (their parity with transformers
is tests/test_parity.py's): settings they do not implement are refused by name."""

from __future__ import annotations

import pytest
from tiny_models import make_checkpoint

from pagedllm import LLM
from pagedllm.core.errors import ConfigError

REFUSED = [
    ("falcon_mqa", dict(alibi=True), "Falcon with alibi=True"),
    (
        "falcon",
        dict(parallel_attn=False),
        "Falcon with new_decoder_architecture and parallel_attn=False",
    ),
    ("phi", dict(tie_word_embeddings=True), "PhiForCausalLM with tie_word_embeddings"),
]


@pytest.mark.parametrize(("name", "overrides", "message"), REFUSED)
def test_unsupported_settings_are_refused_by_name(tmp_path, name, overrides, message):
    directory = make_checkpoint(tmp_path / name, name, **overrides)
    with pytest.raises(ConfigError, match=message):
        LLM(str(directory), dtype="float32")
