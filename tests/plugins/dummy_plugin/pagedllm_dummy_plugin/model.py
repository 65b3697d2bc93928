"""A GPT-NeoX (Pythia) of the plugin's own, registered as ``DummyNeoXForCausalLM``: it
runs the checkpoints ``transformers`` writes for ``GPTNeoXForCausalLM`` whose config names
that architecture instead (pagedllm ships its own ``GPTNeoXForCausalLM``, which a plugin
could replace only with ``override=True``). Module names mirror Hugging Face's, so
checkpoint tensors load by name."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.core.attention import Attention
from pagedllm.core.interfaces import ModelArchitecture
from pagedllm.core.layers.linear import Linear
from pagedllm.core.layers.rotary import RotaryEmbedding


# [docs:model]
class NeoXAttention(nn.Module):
    def __init__(self, config, layer_index, quant_config, prefix, max_positions):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        bias = config.attention_bias
        # Linear lets --quantization take over the layer's storage and matmul.
        self.query_key_value = Linear(
            hidden, 3 * hidden, bias, quant_config, f"{prefix}.query_key_value"
        )
        self.dense = Linear(hidden, hidden, bias, quant_config, f"{prefix}.dense")
        # Reads partial_rotary_factor from the config: GPT-NeoX rotates a quarter of each head.
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        # Attention hands the computation to the step's backend, over the paged KV cache.
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, layer_index
        )

    def forward(self, positions, hidden, attn_metadata):
        tokens = hidden.shape[0]
        # The checkpoint interleaves q, k and v per head: [heads, 3, head_dim] rows.
        qkv = self.query_key_value(hidden).view(tokens, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = self.rotary(positions, q.contiguous(), k.contiguous())
        out = self.attn(
            q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1), attn_metadata
        )
        return self.dense(out)


class NeoXLayer(nn.Module):
    def __init__(self, config, layer_index, quant_config, prefix, max_positions):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.attention = NeoXAttention(
            config, layer_index, quant_config, f"{prefix}.attention", max_positions
        )
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = Linear(
            hidden, config.intermediate_size, True, quant_config, f"{prefix}.mlp.dense_h_to_4h"
        )
        self.mlp.dense_4h_to_h = Linear(
            config.intermediate_size, hidden, True, quant_config, f"{prefix}.mlp.dense_4h_to_h"
        )
        self.parallel_residual = config.use_parallel_residual

    def forward(self, positions, hidden, attn_metadata):
        attn = self.attention(positions, self.input_layernorm(hidden), attn_metadata)
        mlp_input = hidden if self.parallel_residual else hidden + attn
        h = self.mlp.dense_h_to_4h(self.post_attention_layernorm(mlp_input))
        return hidden + attn + self.mlp.dense_4h_to_h(nn.functional.gelu(h))


class DummyNeoXForCausalLM(nn.Module, ModelArchitecture):
    def __init__(
        self, config, quant_config=None, *, max_positions=None, disable_sliding_window=False
    ):
        super().__init__()
        if config.hidden_act != "gelu":
            raise ValueError(
                f"DummyNeoXForCausalLM: hidden_act {config.hidden_act!r} is not supported"
            )
        max_positions = max_positions or config.max_position_embeddings
        self.gpt_neox = nn.Module()
        self.gpt_neox.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gpt_neox.layers = nn.ModuleList(
            NeoXLayer(config, i, quant_config, f"gpt_neox.layers.{i}", max_positions)
            for i in range(config.num_hidden_layers)
        )
        self.gpt_neox.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.embed_out = Linear(
            config.hidden_size, config.vocab_size, False, quant_config, "embed_out"
        )

    def forward(self, input_ids, positions, attn_metadata):
        # One flat batch: every scheduled token of every request, in order.
        hidden = self.gpt_neox.embed_in(input_ids)
        for layer in self.gpt_neox.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.gpt_neox.final_layer_norm(hidden)

    def compute_logits(self, hidden_states):
        return self.embed_out(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.endswith((".attention.bias", ".attention.masked_bias", ".inv_freq")):
                continue  # buffers older checkpoints saved
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"the checkpoint has a weight {name!r} DummyNeoXForCausalLM does not know"
                )
            if param.shape != tensor.shape:
                shape, expected = tuple(tensor.shape), tuple(param.shape)
                raise ValueError(f"weight {name!r} has shape {shape}, expected {expected}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded


# [/docs:model]
