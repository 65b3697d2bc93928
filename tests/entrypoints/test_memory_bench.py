"""``benchmarks/memory.py`` as a smoke test: its /proc readings (the figures themselves
are the benchmark's business) and an idle measurement of a tiny server."""

from __future__ import annotations

import mmap
import os

import pytest
from repo_paths import ROOT, load_script
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "benchmarks" / "memory.py")


def test_rss_splits_into_anonymous_and_file_pages(bench, tmp_path):
    figures = bench.memory(os.getpid())
    assert figures["rss"] > 0
    assert abs(figures["anon"] + figures["file"] - figures["rss"]) < 2  # (+ shmem)
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"x" * (8 << 20))
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert sum(data[i] for i in range(0, len(data), 4096)) > 0  # every page touched
        files = dict(bench.mapped_files(os.getpid(), top=50))
        assert files["mapped.bin"] == pytest.approx(8, abs=0.1)


def test_an_idle_server_is_measured(bench, tmp_path):
    model = make_checkpoint(tmp_path / "llama", "llama")
    port = bench.free_port()
    command = [
        *bench.CLI, "serve", str(model), "--dtype", "float32",
        "--num-gpu-blocks-override", "64", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    figures = bench.measure(command, port, concurrency=1, prompts=0)
    assert figures["start_s"] > 0
    assert figures["idle"]["rss"] > bench.torch_floor() / 2
    assert "load_peak" not in figures
