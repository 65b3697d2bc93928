"""Mixture-of-experts routing and experts (torch reference, as transformers computes
them): a softmax router picks each token's top-k experts, each expert a gated MLP
``down(act(gate(x)) * up(x))``, and the token's output is their weighted sum."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, each ``[T, top_k]``: the ``top_k`` experts of the softmax (in
    float32) of ``router_logits`` ``[T, experts]`` and their probabilities, divided by
    their sum where ``renormalize``; in ``weights_dtype`` if given, else float32."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``x`` ``[T, hidden]`` through its experts: ``gate_up`` ``[E, 2 * inter, hidden]``
    (each expert's gate rows, then its up rows), ``down`` ``[E, hidden, inter]``,
    ``weights`` and ``ids`` ``[T, top_k]`` from :func:`select_experts`. Experts are taken
    in order, each over the tokens that chose it. An id of ``E`` is an expert held
    elsewhere (expert parallelism), skipped."""
    out = torch.zeros_like(x)
    experts = gate_up.shape[0]
    for expert in ids.unique().tolist():
        if expert == experts:
            continue
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[expert])
        # (index_put_ rather than index_add_: the same sums, without index_add_'s thread
        # pool start on these few rows.)
        out.index_put_((tokens,), (y * weights[tokens, slots, None]).to(out.dtype), accumulate=True)
    return out


def moe_dense(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`moe_reference`'s sums with every expert over every token, weighted 0 where
    the token did not choose it: no data-dependent shapes and no host synchronisation, so
    a decode step can be captured in a CUDA graph (the GPU reads every expert's weights
    for a batch of a few tokens anyway). Experts are added in the same order."""
    experts = gate_up.shape[0]
    # (a column more for the id E, an expert held elsewhere, with weight 0)
    dense = torch.zeros((x.shape[0], experts + 1), dtype=weights.dtype, device=x.device)
    dense.scatter_add_(1, ids, weights)
    out = torch.zeros_like(x)
    for expert in range(experts):
        gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[expert])
        weight = dense[:, expert, None]
        # (where, not a product: an unchosen expert's inf or NaN must not leak through 0)
        out += torch.where(weight != 0, y * weight, 0).to(out.dtype)
    return out
