"""Load formats (built-in and a plugin's) and quantization selected by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import LinearMethod, QuantizationConfig
from pagedllm.core.layers.linear import Linear, LinearGroup
from pagedllm.core.layers.weights import copy_weights
from pagedllm.core.loading import get_model_loader, get_quantization_config
from pagedllm.entrypoints.cli.main import build_parser


class TinyModel(torch.nn.Module):
    """Two linear layers and a model-style ``load_weights``."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 6)
        self.down = torch.nn.Linear(6, 4, bias=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"unexpected weight {name}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def reference_state(seed=0):
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in TinyModel().state_dict().items()}


def load(pm, model_dir, **kwargs):
    config = EngineArgs(model=str(model_dir), use_tqdm_on_load=False, **kwargs)
    config = config.create_engine_config(pm)
    loader = get_model_loader(config.load_config, pm)
    loader.download_model(config.model_config)
    model = TinyModel()
    loader.load_weights(model, config.model_config)
    return loader, model


def assert_state(model, state):
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_safetensors_single_and_sharded(pm, tmp_path):
    state = reference_state()
    single = tmp_path / "single"
    single.mkdir()
    save_file(state, single / "model.safetensors")
    _, model = load(pm, single, load_format="safetensors")
    assert_state(model, state)

    sharded = tmp_path / "sharded"
    (sharded / "original").mkdir(parents=True)
    save_file({"up.weight": state["up.weight"]}, sharded / "model-00001-of-00002.safetensors")
    save_file(
        {"up.bias": state["up.bias"], "down.weight": state["down.weight"]},
        sharded / "model-00002-of-00002.safetensors",
    )
    weight_map = {
        "up.weight": "model-00001-of-00002.safetensors",
        "up.bias": "model-00002-of-00002.safetensors",
        "down.weight": "model-00002-of-00002.safetensors",
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, model = load(pm, sharded, load_format="safetensors")
    assert_state(model, state)


def test_ignore_patterns_skip_duplicate_checkpoints(pm, tmp_path):
    state = reference_state()
    (tmp_path / "original").mkdir()
    save_file(state, tmp_path / "model.safetensors")
    save_file({"bogus": torch.zeros(1)}, tmp_path / "original" / "consolidated.safetensors")
    # The default pattern skips original/; without it the stray tensor is an error.
    loader, _ = load(pm, tmp_path, load_format="safetensors")
    assert [
        f.name
        for f in loader.weight_files(
            EngineArgs(model=str(tmp_path)).create_engine_config(pm).model_config
        )
    ] == ["model.safetensors"]


def test_pt_auto_and_npcache(pm, tmp_path):
    state = reference_state(1)
    torch.save(state, tmp_path / "pytorch_model.bin")
    _, model = load(pm, tmp_path, load_format="pt")
    assert_state(model, state)
    loader, model = load(pm, tmp_path, load_format="auto")
    assert_state(model, state)
    assert type(loader._chosen).__name__ == "PtLoader"

    cache_dir = tmp_path / "cache"
    _, model = load(pm, tmp_path, load_format="npcache", download_dir=str(cache_dir))
    assert_state(model, state)
    assert list(cache_dir.rglob("npcache_index.json"))
    # The second load reads only the cache: the original checkpoint can be gone.
    (tmp_path / "pytorch_model.bin").unlink()
    _, model = load(pm, tmp_path, load_format="npcache", download_dir=str(cache_dir))
    assert_state(model, state)

    save_file(reference_state(2), tmp_path / "model.safetensors")
    loader, model = load(pm, tmp_path, load_format="auto")
    assert type(loader._chosen).__name__ == "SafetensorsLoader"
    assert_state(model, reference_state(2))


def test_npcache_keeps_bfloat16(pm, tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in reference_state(3).items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    config = EngineArgs(
        model=str(tmp_path), load_format="npcache", use_tqdm_on_load=False
    ).create_engine_config(pm)
    loader = get_model_loader(config.load_config, pm)
    first = dict(loader.iter_weights(config.model_config))
    second = dict(loader.iter_weights(config.model_config))
    for name, tensor in state.items():
        assert first[name].dtype == torch.bfloat16 and torch.equal(first[name], tensor)
        assert torch.equal(second[name], tensor)


def test_dummy_weights_are_small_and_reproducible(pm, tmp_path):
    _, a = load(pm, tmp_path, load_format="dummy", seed=5)
    _, b = load(pm, tmp_path, load_format="dummy", seed=5)
    _, c = load(pm, tmp_path, load_format="dummy", seed=6)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0, name
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_loader_errors_name_the_problem(pm, tmp_path):
    save_file({"up.weight": torch.zeros(6, 4)}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="no weights for 2 parameter.*down.weight"):
        load(pm, tmp_path, load_format="safetensors")
    with pytest.raises(ConfigError, match="no \\*.bin or \\*.pt weight files"):
        load(pm, tmp_path, load_format="pt")
    with pytest.raises(ConfigError, match="model path .*/not_here' does not exist"):
        load(pm, tmp_path / "not_here", load_format="pt")
    with pytest.raises(ConfigError, match="neither a local path nor in .*does not download"):
        load(pm, "nobody/no-such-model-xyz", load_format="safetensors")
    with pytest.raises(ConfigError, match="unknown key.*'speed'"):
        load(pm, tmp_path, load_format="safetensors", model_loader_extra_config={"speed": 1})


def test_plugin_load_format_selected_from_the_command_line(pm, tmp_path):
    state = reference_state(4)
    (tmp_path / "weights.json").write_text(json.dumps({k: v.tolist() for k, v in state.items()}))
    parser, _ = build_parser(pm)
    args = parser.parse_args(["serve", str(tmp_path), "--load-format", "dummyfmt"])
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag
    config = engine_args.create_engine_config(pm)
    loader = get_model_loader(config.load_config, pm)
    assert type(loader).__module__ == "pagedllm_dummy_plugin.loader"
    model = TinyModel()
    loader.load_weights(model, config.model_config)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(tensor, state[name]), name


def test_plugin_quantization_selected_from_the_command_line(pm):
    parser, _ = build_parser(pm)
    args = parser.parse_args(["serve", "m", "--quantization", "dummyq"])
    config = EngineArgs.from_cli_args(args).create_engine_config(pm)
    quant = get_quantization_config(config.model_config.quantization, pm)
    assert type(quant).__module__ == "pagedllm_dummy_plugin.quant"

    torch.manual_seed(0)
    weight = torch.randn(8, 16)
    x = torch.randn(3, 16)
    layer = torch.nn.Module()
    method = quant.get_linear_method(layer, "model.layers.0.mlp.up_proj")
    method.create_weights(layer, 16, 8, torch.float32)
    method.quantize_into(layer, weight)
    assert layer.qweight.dtype == torch.int8
    out = method.apply(layer, x)
    reference = torch.nn.functional.linear(x, weight)
    assert torch.allclose(out, reference, atol=0.05)
    assert not torch.equal(out, reference)  # it really went through int8

    skipping = get_quantization_config("dummyq", pm, {"skip_prefixes": ["lm_head"]})
    assert skipping.get_linear_method(layer, "lm_head") is None
    with pytest.raises(ConfigError, match="dummyq does not understand"):
        get_quantization_config("dummyq", pm, {"bits": 3})
    with pytest.raises(ConfigError, match="quantized with 'awq'"):
        get_quantization_config("dummyq", pm, {"quant_method": "awq"})
    assert get_quantization_config(None, pm) is None


# ------------------------------------------------ layers fused at construction, loaded by name


class _RowScaledMethod(LinearMethod):
    """Float weights with a per-row scale; declares no ``fuse``."""

    def create_weights(self, layer, input_size, output_size, params_dtype):
        layer.weight = torch.nn.Parameter(torch.empty(output_size, input_size), False)
        layer.scale = torch.nn.Parameter(torch.ones(output_size, 1), False)

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight * layer.scale, bias)


class _ScaleLast(QuantizationConfig):
    name = "scale_last"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_linear_method(self, layer, prefix):
        return _RowScaledMethod() if prefix.endswith("v_proj") else None


class _Attention(torch.nn.Module):
    def __init__(self, quant=None, bias=(False, True, False)):
        super().__init__()
        self.q_proj = Linear(16, 8, bias[0], quant, "q_proj")
        self.k_proj = Linear(16, 4, bias[1], quant, "k_proj")
        self.v_proj = Linear(16, 4, bias[2], quant, "v_proj")
        self.qkv = LinearGroup([self.q_proj, self.k_proj, self.v_proj])


def _load_random(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    state = {name: torch.randn(p.shape) for name, p in module.named_parameters()}
    copy_weights(module, state.items())
    return state


def test_unquantized_group_is_one_product_over_the_layers_storage():
    attn = _Attention()
    (run,) = attn.qkv.runs  # fused when built, before any weight exists
    # The checkpoint's names, nothing more: the fused tensors are not parameters.
    assert {n for n, _ in attn.named_parameters()} == {
        "q_proj.weight",
        "k_proj.weight",
        "k_proj.bias",
        "v_proj.weight",
    }
    assert not attn.state_dict().keys() - {n for n, _ in attn.named_parameters()}
    state = _load_random(attn)
    assert attn.q_proj.weight.data_ptr() == run.weight.data_ptr()  # a view, not a copy
    x = torch.randn(5, 16)
    q, k, v = attn.qkv(x)
    F = torch.nn.functional
    assert torch.allclose(q, F.linear(x, state["q_proj.weight"]), atol=1e-5)
    assert torch.allclose(k, F.linear(x, state["k_proj.weight"], state["k_proj.bias"]), atol=1e-5)
    assert torch.allclose(v, F.linear(x, state["v_proj.weight"]), atol=1e-5)


def test_a_layer_whose_method_cannot_fuse_is_computed_on_its_own():
    attn = _Attention(_ScaleLast())
    assert [type(run).__name__ for run in attn.qkv.runs] == ["FusedLinear", "_Single"]
    state = _load_random(attn)
    x = torch.randn(5, 16)
    q, k, v = attn.qkv(x)
    expected = torch.nn.functional.linear(x, state["v_proj.weight"] * state["v_proj.scale"])
    assert torch.allclose(v, expected, atol=1e-5)
    assert torch.allclose(q, torch.nn.functional.linear(x, state["q_proj.weight"]), atol=1e-5)
    assert q.shape == (5, 8) and k.shape == (5, 4)
