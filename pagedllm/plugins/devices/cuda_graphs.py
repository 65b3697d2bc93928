"""Decode steps replayed from CUDA graphs.

A decode step (every request adds one token) launches the same kernels whatever its
tokens, so for each capture size B (``--cuda-graph-sizes``) the model's forward pass over
B tokens is recorded once into a CUDA graph reading fixed device buffers: token ids,
positions, cache slots, each request's context length and block table. A step of ``n <=
B`` decodes whose contexts are at most ``--max-seq-len-to-capture`` tokens copies its
inputs into those buffers (two host-to-device copies from pinned memory) and replays the
graph of the smallest B that holds it: one launch in place of hundreds. Rows past ``n``
are padding: they write and read the runner's spare block (``runner.pad_block``), which
no request owns. Other steps (prompts, chunks, speculative verification, adapters) run
eagerly.

``DecodeGraphs(use_graphs=False)`` runs the same buffers without capturing, which is how
the padding and buffer logic is tested on CPU (Triton interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from pagedllm.core.layers.static import recording_static_shapes
from pagedllm.plugins.devices.cuda_attention import TritonMetadata

logger = logging.getLogger(__name__)


def decode_graphs(runner: Any, config: Any, use_graphs: bool = True) -> DecodeGraphs | None:
    """The cuda device's ``decode_graphs``: a :class:`DecodeGraphs` for ``runner`` with the
    sizes and the longest context of ``config.compilation_config``, captured (with
    ``use_graphs``); ``None`` (every step eager) for another attention backend than
    triton_paged, whose metadata the graphs' buffers are, or when capture fails."""
    from pagedllm.plugins.devices.cuda_attention import TritonPagedBackend

    if not isinstance(runner.attention_backend, TritonPagedBackend):
        logger.info(
            "CUDA graphs off: they are captured for the triton_paged attention backend, not %s",
            runner.attention_backend.name,
        )
        return None
    compilation = config.compilation_config
    graphs = DecodeGraphs(
        runner,
        list(compilation.capture_sizes),
        compilation.max_seq_len_to_capture,
        use_graphs=use_graphs,
    )
    return graphs.capture() if use_graphs else graphs


class DecodeGraphs:
    def __init__(
        self, runner: Any, sizes: list[int], max_seq_len: int, use_graphs: bool = True
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        self.runner = runner
        self.sizes = sorted(sizes)
        self.use_graphs = use_graphs
        self.max_batch = self.sizes[-1]
        block_size = runner.block_size
        pad = runner.pad_block
        self.pad_slot = pad * block_size
        num_slots = runner.kv_caches[0].shape[1] * block_size
        self.max_context = min(max_seq_len, num_slots)
        self.width = -(-self.max_context // block_size)
        device = runner.device
        b = self.max_batch
        # Rows: token ids, positions, cache slots, then seq_ranges (each request's first
        # and end token, context length), so that one copy fills a step.
        self.inputs = torch.zeros((6, b), dtype=torch.long, device=device)
        self.inputs[2].fill_(self.pad_slot)
        self.inputs[3] = torch.arange(b, device=device)
        self.inputs[4] = torch.arange(1, b + 1, device=device)
        self.inputs[5].fill_(1)
        self.tables = torch.full((b, self.width), pad, dtype=torch.int32, device=device)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        # Decode steps run from the buffers (replayed, with use_graphs).
        self.replays = 0
        # Padding of a host row of ids, positions, slots, first and end token, context.
        self._pad_ids = [0] * b
        self._pad_slots = [self.pad_slot] * b
        self._ones = [1] * b
        self._starts = list(range(b))
        self._ends = list(range(1, b + 1))
        self._pad_row = [pad] * self.width

    def metadata(self, size: int) -> TritonMetadata:
        return TritonMetadata(
            num_tokens=size,
            slot_mapping=self.inputs[2, :size],
            seq_ranges=self.inputs[3:6, :size],
            block_tables=self.tables[:size],
            token_seq=self.token_seq[:size],
            kv_caches=self.runner.kv_caches,
            backend=self.runner.attention_backend,
        )

    def _forward(self, size: int) -> torch.Tensor:
        with recording_static_shapes():
            return self.runner.model(
                self.inputs[0, :size], self.inputs[1, :size], self.metadata(size)
            )

    @torch.inference_mode()
    def capture(self) -> DecodeGraphs | None:
        """Record a graph per size (largest first, sharing one memory pool). A size whose
        capture fails (a host synchronisation in the model's forward pass, say) is left
        out with a warning naming the reason; ``None`` when none was captured: then every
        step runs eagerly."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.current_stream()
        failures: list[tuple[int, BaseException]] = []
        for size in reversed(self.sizes):
            try:
                # Warm-up: Triton compiles, torch.compile specialises, the allocator settles.
                self._forward(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = self._forward(size)
                self.graphs[size] = (graph, out)
            except Exception as exc:  # a forward pass that cannot be captured
                # (torch's graph context leaves its capture stream current when ending
                # the capture raises)
                torch.cuda.set_stream(stream)
                failures.append((size, exc))
        torch.cuda.synchronize()
        if failures:
            logger.warning(
                "CUDA graphs: capture failed for batch sizes %s (those steps run eagerly): %s",
                sorted(size for size, _ in failures),
                failures[0][1],
            )
        if not self.graphs:
            return None
        self.sizes = sorted(self.graphs)
        self.max_batch = self.sizes[-1]
        logger.info(
            "captured CUDA graphs of decode steps for %d batch sizes (%d to %d, contexts up "
            "to %d tokens) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.max_batch,
            self.max_context,
            time.perf_counter() - start,
        )
        return self

    def covers(self, num_decodes: int, max_context: int) -> bool:
        return num_decodes <= self.max_batch and max_context <= self.max_context

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """The hidden states of a decode step of ``len(token_ids)`` requests (one token
        each, at ``positions``) that ``covers`` accepts."""
        n = len(token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        block_size = self.runner.block_size
        pad = size - n
        slots = [
            blocks[pos // block_size] * block_size + pos % block_size
            for blocks, pos in zip(block_tables, positions, strict=True)
        ]
        rows = [
            token_ids + self._pad_ids[:pad],
            positions + self._pad_ids[:pad],
            slots + self._pad_slots[:pad],
            self._starts[:size],
            self._ends[:size],
            context_lens + self._ones[:pad],
        ]
        width = -(-max(context_lens) // block_size)
        flat: list[int] = []
        for blocks, context in zip(block_tables, context_lens, strict=True):
            used = -(-context // block_size)
            flat.extend(blocks[:used])
            flat.extend(self._pad_row[: width - used])
        flat.extend(self._pad_row[:width] * pad)
        pinned = self.use_graphs
        host = torch.tensor(rows, dtype=torch.long)
        tables = torch.tensor(flat, dtype=torch.int32).view(size, width)
        if pinned:
            host, tables = host.pin_memory(), tables.pin_memory()
        self.inputs[:, :size].copy_(host, non_blocking=pinned)
        self.tables[:size, :width].copy_(tables, non_blocking=pinned)
        self.replays += 1
        if not self.use_graphs:
            return self._forward(size)[:n]
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
