"""The compiled CPU kernels for GGUF weights (``csrc/gguf_cpu.c``), built on first use.

The C file is compiled with the system C compiler (``cc``, or ``$CC``) for this machine's
CPU into ``$PAGEDLLM_CACHE_ROOT/kernels`` (default ``~/.cache/pagedllm/kernels``) and
loaded with ctypes; it links OpenMP under the same soname as torch's, so both share one
thread pool. Without a compiler, or with ``PAGEDLLM_DISABLE_CPU_KERNELS=1``, callers fall
back to the torch reference (:mod:`pagedllm.kernels.gguf_dequant`), with one warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["GGUFCpuKernels", "cpu_kernels"]

logger = logging.getLogger("pagedllm.kernels")

_SOURCE = Path(__file__).with_name("csrc") / "gguf_cpu.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: GGUFCpuKernels | None = None
_failed = False


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_ROOT")
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedllm" / "kernels"


def _cpu_flags() -> str:
    # -march=native code is only valid on a CPU with the same features, so the flags are
    # part of the cache key (a shared home directory may see several machines).
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC or install gcc)")
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join([compiler, *_FLAGS, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"gguf_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(_SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    logger.info("built the GGUF CPU kernels: %s", target)
    return target


class GGUFCpuKernels:
    """ctypes bindings of the compiled library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pagedllm_gguf_supported.argtypes = [i32]
        lib.pagedllm_gguf_supported.restype = i32
        lib.pagedllm_gguf_dequant.argtypes = [i32, ptr, i64, i64, i64, ptr, i32]
        lib.pagedllm_gguf_dequant.restype = i32
        lib.pagedllm_gguf_matmul.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32]
        lib.pagedllm_gguf_matmul.restype = i32
        self.lib = lib
        self.path = path

    def supports(self, qtype: int) -> bool:
        return bool(self.lib.pagedllm_gguf_supported(int(qtype)))

    def dequantize(self, raw: torch.Tensor, qtype: int, rows: int, k: int) -> torch.Tensor:
        """float32 ``[rows, k]`` from uint8 ``[rows, row_bytes]`` (contiguous, on the cpu)."""
        raw = raw.contiguous()
        out = torch.empty(rows, k, dtype=torch.float32)
        status = self.lib.pagedllm_gguf_dequant(
            int(qtype),
            raw.data_ptr(),
            rows,
            raw.shape[-1],
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"GGML type {qtype} is not supported by the CPU kernels")
        return out

    def matmul(
        self, x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int
    ) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x`` ``[m, k]`` and packed ``W`` ``[n, row_bytes]``."""
        x = x.contiguous()
        raw = raw.contiguous()
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        status = self.lib.pagedllm_gguf_matmul(
            int(qtype),
            raw.data_ptr(),
            n,
            raw.shape[-1],
            k,
            x.data_ptr(),
            m,
            k,
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if status == -1:
            raise ValueError(f"GGML type {qtype} is not supported by the CPU kernels")
        if status != 0:
            raise MemoryError("the GGUF matmul could not allocate its row buffer")
        return y


def cpu_kernels() -> GGUFCpuKernels | None:
    """The compiled kernels, or ``None`` (after one warning) when they cannot be built."""
    global _loaded, _failed
    if _loaded is not None or _failed:
        return _loaded
    with _lock:
        if _loaded is not None or _failed:
            return _loaded
        if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
            _failed = True
            return None
        try:
            _loaded = GGUFCpuKernels(_build())
        except (OSError, RuntimeError) as exc:
            _failed = True
            logger.warning(
                "GGUF CPU kernels unavailable, using the (slower) torch reference: %s", exc
            )
    return _loaded
