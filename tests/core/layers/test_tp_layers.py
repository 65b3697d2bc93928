"""Tensor-parallel layers and models on a real two-rank gloo group on the CPU.

Two spawned processes join one group; each builds the same layers (or the same tiny
checkpoint's model) for its rank, loads its shard from the full tensors through
``copy_weights`` and runs them. Both ranks must return the unsharded computation: the
parent computes it in its own (one-rank) process and compares.
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from tiny_models import make_checkpoint

from pagedllm.core.attention.torch_backend import TorchSDPABackend
from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear, LinearGroup
from pagedllm.core.layers.weights import copy_weights
from pagedllm.distributed import parallel_state
from pagedllm.plugins.models import llama
from pagedllm.plugins.models.bert import BertModel
from pagedllm.plugins.models.classification import LlamaForSequenceClassification
from pagedllm.plugins.models.common import kv_head_share
from pagedllm.plugins.models.gpt2 import GPT2LMHeadModel
from pagedllm.plugins.models.moe import MixtralForCausalLM
from pagedllm.plugins.models.phi import PhiForCausalLM
from pagedllm.plugins.models.phi3 import Phi3ForCausalLM
from pagedllm.plugins.models.transformers_backend import TransformersForCausalLM

RANKS = 2
BLOCK_SIZE = 16
PROMPT = [3, 17, 200, 42, 7, 510]  # (510: in the last rank's rows of a 511 vocabulary)
NEXT = [99]
# name -> (tiny_models architecture, config overrides): a tied head over an odd vocabulary
# (padded embedding rows), an untied head over an odd vocabulary with one KV head for
# two ranks (replicated), and Qwen3's per-head Q/K norms with head_dim != hidden / heads.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_tied": ("llama", {"vocab_size": 511}),
    "llama_one_kv_head": ("llama3_rope", {"vocab_size": 511}),
    "qwen3": ("qwen3", {}),
}


# --- what each rank (and the one-rank reference) computes -----------------------------


def _linear_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "col.weight": torch.randn(16, 8, generator=gen),
        "col.bias": torch.randn(16, generator=gen),
        "row.weight": torch.randn(8, 16, generator=gen),
        "row.bias": torch.randn(8, generator=gen),
        "k.weight": torch.randn(6, 8, generator=gen),
        "k.bias": torch.randn(6, generator=gen),
        "x": torch.randn(3, 8, generator=gen),
    }


def _embedding_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {
        "emb.weight": torch.randn(11, 6, generator=gen),
        "ids": torch.tensor([0, 5, 6, 10, 3, 10]),
        "x": torch.randn(4, 6, generator=gen),
    }


def _run_linear() -> dict[str, torch.Tensor]:
    """A column layer feeding a row layer (MLP-style, one all-reduce), and a group of the
    column layer with a column layer whose explicit shard is the same on every rank."""
    t = _linear_tensors()
    module = torch.nn.Module()
    module.col = Linear(8, 16, True, parallel="column")
    module.row = Linear(16, 8, True, parallel="row")
    # Rows [2, 4) on every rank (a replicated KV head of two rows).
    module.k = Linear(8, 6, True, parallel="column", shard=(2, 2))
    group = LinearGroup([module.col, module.k])
    loaded = copy_weights(module, ((n, v) for n, v in t.items() if n != "x"))
    assert loaded == {n for n in t if n != "x"}
    col, k = group(t["x"])
    return {
        "mlp": module.row(col),
        "col": parallel_state.all_gather(col, dim=-1),
        "k": k,
    }


def _run_embedding() -> dict[str, torch.Tensor]:
    t = _embedding_tensors()
    emb = VocabEmbedding(11, 6, prefix="emb")
    module = torch.nn.Module()
    module.emb = emb
    copy_weights(module, [("emb.weight", t["emb.weight"])])
    return {"lookup": emb(t["ids"]), "logits": emb.as_linear(t["x"])}


def _run_model(directory: str) -> dict[str, torch.Tensor]:
    """Logits of a prefill of PROMPT and of a decode of NEXT after it."""
    config = transformers.AutoConfig.from_pretrained(directory)
    model_cls = getattr(llama, config.architectures[0])
    model_cls.check_tensor_parallel(config, parallel_state.tp_size())
    model = model_cls(config)
    weights = safetensors.torch.load_file(str(Path(directory) / "model.safetensors"))
    model.load_weights(weights.items())
    model.process_weights_after_loading()
    model.eval()
    attn = model.model.layers[0].self_attn
    kv_heads = kv_head_share(config.num_key_value_heads)[1]
    assert attn.num_kv_heads == kv_heads
    assert attn.num_heads == config.num_attention_heads // parallel_state.tp_size()
    caches = [
        torch.zeros(2, 2, BLOCK_SIZE, kv_heads, attn.head_dim)
        for _ in range(config.num_hidden_layers)
    ]
    backend, cpu = TorchSDPABackend(), torch.device("cpu")
    out = {}
    with torch.no_grad():
        n = len(PROMPT)
        metadata = backend.build_metadata([n], [n], [[0]], BLOCK_SIZE, caches, cpu)
        hidden = model(torch.tensor(PROMPT), torch.arange(n), metadata)
        out["prefill"] = model.compute_logits(hidden)
        metadata = backend.build_metadata([1], [n + 1], [[0]], BLOCK_SIZE, caches, cpu)
        hidden = model(torch.tensor(NEXT), torch.tensor([n]), metadata)
        out["decode"] = model.compute_logits(hidden)
    return out


def _compute(directories: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {"linear": _run_linear(), "embedding": _run_embedding()}
    for name, directory in directories.items():
        results[name] = _run_model(directory)
    return results


def _worker(rank: int, address: str, directories: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    try:
        parallel_state.init_distributed(rank, RANKS, address, "gloo", timeout_s=60)
        result: dict[str, Any] = _compute(directories)
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, out)
    parallel_state.destroy_distributed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        name: str(make_checkpoint(root / name, arch, **overrides))
        for name, (arch, overrides) in MODELS.items()
    }


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory) -> list[dict[str, Any]]:
    """Each rank's results."""
    out = tmp_path_factory.mktemp("tp_out")
    address = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    files = [str(out / f"rank{rank}.pt") for rank in range(RANKS)]
    procs = [
        ctx.Process(target=_worker, args=(rank, address, checkpoints, files[rank]))
        for rank in range(RANKS)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=150)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    results = []
    for rank, path in enumerate(files):
        assert Path(path).exists(), f"rank {rank} wrote nothing (exit code {procs[rank].exitcode})"
        result = torch.load(path)
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        results.append(result)
    return results


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- the two-rank group ----------------------------------------------------------------


def test_column_then_row_linear_is_the_full_product(ranks):
    t = _linear_tensors()
    hidden = F.linear(t["x"], t["col.weight"], t["col.bias"])
    expected = F.linear(hidden, t["row.weight"], t["row.bias"])
    for result in ranks:
        _close(result["linear"]["mlp"], expected)
        # The fused group computes each rank's own rows of the column layer...
        _close(result["linear"]["col"], hidden)
    # ... and the explicit shard's rows, the same on both ranks.
    for result in ranks:
        _close(result["linear"]["k"], F.linear(t["x"], t["k.weight"], t["k.bias"])[:, 2:4])


def test_vocab_parallel_embedding_and_tied_head(ranks):
    t = _embedding_tensors()
    for result in ranks:
        _close(result["embedding"]["lookup"], F.embedding(t["ids"], t["emb.weight"]))
        logits = result["embedding"]["logits"]
        assert logits.shape == (4, 11)  # the padding row's logits dropped
        _close(logits, F.linear(t["x"], t["emb.weight"]))


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_model_matches_the_unsharded_one(ranks, checkpoints, name):
    expected = _run_model(checkpoints[name])
    vocab = transformers.AutoConfig.from_pretrained(checkpoints[name]).vocab_size
    assert expected["prefill"].shape == (len(PROMPT), vocab)
    for result in ranks:
        for step in ("prefill", "decode"):
            assert result[name][step].shape == expected[step].shape
            _close(result[name][step], expected[step])


# --- one process -----------------------------------------------------------------------


@pytest.fixture
def rank_one_of_two():
    """This process as rank 1 of 2 (layers built now shard; nothing is computed)."""
    parallel_state.set_tensor_parallel(1, 2)
    yield
    parallel_state.set_tensor_parallel(0, 1)


def test_layers_shard_only_with_several_ranks(rank_one_of_two):
    col = Linear(8, 16, True, parallel="column")
    row = Linear(16, 8, True, parallel="row")
    assert (col.output_size, col.weight.shape, col.weight.tp_narrow) == (8, (8, 8), (0, 8, 8))
    assert col.bias.tp_narrow == (0, 8, 8)
    assert (row.input_size, row.weight.shape, row.weight.tp_narrow) == (8, (8, 8), (1, 8, 8))
    assert row.reduce_output and not hasattr(row.bias, "tp_narrow")  # the full bias
    emb = VocabEmbedding(11, 6)
    assert (emb.vocab_start, emb.num_local, tuple(emb.weight.shape)) == (6, 6, (6, 6))
    # Rank 1's KV heads: its share of 4, or the second of 1 replicated over 2.
    assert kv_head_share(4) == (2, 2) and kv_head_share(1) == (0, 1)
    parallel_state.set_tensor_parallel(0, 1)
    plain = Linear(16, 8, True, parallel="row")
    assert plain.input_size == 16 and not plain.reduce_output
    assert not hasattr(plain.weight, "tp_narrow")
    assert not VocabEmbedding(11, 6).vocab_parallel


def test_kv_head_replication_over_more_ranks():
    parallel_state.set_tensor_parallel(3, 4)
    try:
        assert kv_head_share(2) == (1, 1)  # ranks 2 and 3 share the second head
        assert kv_head_share(8) == (6, 2)
    finally:
        parallel_state.set_tensor_parallel(0, 1)


def test_quantized_layers_split_where_their_layout_allows(rank_one_of_two):
    """GGUF rows split anywhere, columns at whole blocks (as bytes of the packed rows);
    a layout that cannot be split (fp8 here, a K-quant's 256-value block across the
    shard) is refused by name."""
    from pagedllm.kernels.ggml_types import GGMLQuantizationType as T
    from pagedllm.plugins.quantization.fp8 import Fp8Config
    from pagedllm.plugins.quantization.gguf import GGUFConfig

    with pytest.raises(ConfigError, match="fp8: layer 'q' cannot be split over 2"):
        Linear(8, 16, quant_config=Fp8Config.from_config({}), prefix="q", parallel="column")
    gguf = GGUFConfig({"emb.weight": T.Q8_0, "down.weight": T.Q4_1, "k.weight": T.Q4_K})
    embedding = VocabEmbedding(64, 32, gguf, "emb")
    assert embedding.weight.tp_narrow == (0, 32, 32)  # rank 1's rows
    down = Linear(128, 16, quant_config=gguf, prefix="down", parallel="row")
    # Columns 64..127 of Q4_1 (20 bytes per 32 values): bytes 40..79 of each row.
    assert down.weight.tp_narrow == (1, 40, 40) and down.gguf_shape == (16, 64)
    with pytest.raises(ConfigError, match="gguf: layer 'k' cannot be split"):
        Linear(256, 16, quant_config=gguf, prefix="k", parallel="row")


def test_bad_parallel_arguments():
    with pytest.raises(ValueError, match="parallel must be"):
        Linear(8, 8, parallel="diagonal")
    with pytest.raises(ValueError, match="explicit shard"):
        Linear(8, 8, parallel="row", shard=(0, 4))


def _llama_config(**kwargs: Any) -> Any:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)
    return transformers.LlamaConfig(**{**base, **kwargs})


def test_check_tensor_parallel():
    config = _llama_config()
    for size in (1, 2, 4, 8):  # 4 and 8 ranks replicate the 2 KV heads
        llama.LlamaForCausalLM.check_tensor_parallel(config, size)
        llama.Qwen3ForCausalLM.check_tensor_parallel(config, size)
    with pytest.raises(ConfigError, match="its 8 attention heads do not divide by 3"):
        llama.MistralForCausalLM.check_tensor_parallel(config, 3)
    with pytest.raises(ConfigError, match="its 6 KV heads do not divide by 4"):
        llama.Qwen2ForCausalLM.check_tensor_parallel(_llama_config(num_key_value_heads=6), 4)
    with pytest.raises(ConfigError, match="4 is not a multiple of its 3 KV heads"):
        llama.LlamaForCausalLM.check_tensor_parallel(
            _llama_config(hidden_size=96, num_attention_heads=12, num_key_value_heads=3), 4
        )
    with pytest.raises(ConfigError, match="intermediate size 130 does not divide by 4"):
        llama.LlamaForCausalLM.check_tensor_parallel(_llama_config(intermediate_size=130), 4)


def test_expert_parallelism_splits_the_number_of_experts():
    """With --enable-expert-parallel the experts divide over the ranks, not their rows."""
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=90, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4,
    )  # fmt: skip
    MixtralForCausalLM.check_tensor_parallel(config, 2, experts=True)
    with pytest.raises(ConfigError, match="intermediate size 90 does not divide by 4"):
        MixtralForCausalLM.check_tensor_parallel(config, 4)
    config.num_local_experts = 6
    with pytest.raises(ConfigError, match="num local experts 6 does not divide by 4"):
        MixtralForCausalLM.check_tensor_parallel(config, 4, experts=True)
    # (a dense model's check takes the keyword too, which changes nothing there)
    llama.LlamaForCausalLM.check_tensor_parallel(_llama_config(), 2, experts=True)
    from pagedllm.executors.base import _check_expert_parallel

    class Older(llama.LlamaForCausalLM):  # (a plugin's check from before the keyword)
        @classmethod
        def check_tensor_parallel(cls, config, size):
            pass

    with pytest.raises(ConfigError, match="Older does not support --enable-expert-parallel"):
        _check_expert_parallel(Older, config, 2)


def test_the_transformers_backend_splits_what_the_models_plan_says():
    """--model-impl transformers: a plan of linear layers by rows and columns splits
    (norms left whole); a model without a plan, with a plan pagedllm does not follow, or
    with fewer KV heads than ranks is refused by name."""
    TransformersForCausalLM.check_tensor_parallel(transformers.Qwen3Config(), 2)
    for config, message in [
        (transformers.GPT2Config(), "gpt2 declares no tensor-parallel plan"),
        (transformers.Phi3Config(), "splits layers as \\['colwise_gather_output'"),
        (_llama_config(num_key_value_heads=1), "its KV heads 1 do not divide by 2"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TransformersForCausalLM.check_tensor_parallel(config, 2)


def test_unsupported_architectures_are_named():
    config = _llama_config()

    class Derived(llama.LlamaForCausalLM):
        pass

    # Subclasses of a supported architecture do not inherit the support.
    for model_cls in (Derived,):
        assert not model_cls.supports_tensor_parallel
        model_cls.check_tensor_parallel(config, 1)
        with pytest.raises(ConfigError, match=f"{model_cls.__name__} does not support tensor"):
            model_cls.check_tensor_parallel(config, 2)
    assert llama.Qwen3ForCausalLM.supports_tensor_parallel
    assert Phi3ForCausalLM.supports_tensor_parallel  # (set on the class itself)
    assert PhiForCausalLM.supports_tensor_parallel
    assert MixtralForCausalLM.supports_tensor_parallel
    assert LlamaForSequenceClassification.supports_tensor_parallel
    assert GPT2LMHeadModel.supports_tensor_parallel
    assert BertModel.supports_tensor_parallel and not BertModel.supports_pipeline_parallel
