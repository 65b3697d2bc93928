"""Building and loading the C kernels of ``csrc/``, on first use, for this machine.

Each C file is compiled with the system C compiler (``cc``, or ``$CC``) with
``-march=native`` into ``$PAGEDLLM_CACHE_ROOT/kernels`` (default
``~/.cache/pagedllm/kernels``), keyed by its source, the flags and the CPU's feature
flags, and loaded with ctypes; OpenMP is linked under the same soname as torch's, so
both share one thread pool. The vector paths (AVX-512, AVX2, ...) are therefore chosen
by the compiler for the CPU at hand, at run time. Without a compiler, or with
``PAGEDLLM_DISABLE_CPU_KERNELS=1``, :func:`load_kernel_library` returns None (after one
warning) and callers use their torch reference. Tests build a library for another
(older) x86 target with ``load_kernel_library(name, march="haswell")``, say, to run its
AVX2 or plain C paths on this machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = [
    "CSRC",
    "c_compiler",
    "cpu_flags",
    "cpuinfo_field",
    "kernels_disabled",
    "load_kernel_library",
]

logger = logging.getLogger("pagedllm.kernels")

CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}


def kernels_disabled() -> bool:
    return os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0")


def cache_dir(kind: str) -> Path:
    """Where pagedllm keeps what it derives once per machine (``kernels``, converted
    ``tokenizers``): ``$PAGEDLLM_CACHE_ROOT/<kind>``, else
    ``$XDG_CACHE_HOME/pagedllm/<kind>``, else ``~/.cache/pagedllm/<kind>``."""
    root = os.environ.get("PAGEDLLM_CACHE_ROOT")
    if root:
        return Path(root).expanduser() / kind
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedllm" / kind


def _cache_dir() -> Path:
    return cache_dir("kernels")


@functools.cache
def cpuinfo_field(key: str) -> str | None:
    """The first ``key`` line of ``/proc/cpuinfo`` (e.g. ``flags``, ``model name``), or
    None where there is no such file or line."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``). ``-march=native`` code is only valid on
    a CPU with the same features, so they are part of the cache key (a shared home
    directory may see several machines)."""
    return cpuinfo_field("flags") or ""


def c_compiler() -> str | None:
    """The C compiler the kernels are built with (``$CC``, else ``cc`` or ``gcc``)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(source: Path, march: str = "native") -> Path:
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC or install gcc)")
    flags = [f if f != "-march=native" else f"-march={march}" for f in _FLAGS]
    # Every file of csrc/ is part of the key: a source may #include the others.
    sources = b"".join(path.read_bytes() for path in sorted(CSRC.glob("*.[ch]")))
    key = hashlib.sha256(
        source.name.encode() + sources + " ".join([compiler, *flags, cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, "-o", str(built), str(source), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    logger.info("built the CPU kernels %s: %s", source.name, target)
    return target


def load_kernel_library(name: str, march: str = "native") -> ctypes.CDLL | None:
    """``csrc/<name>.c`` compiled (for ``-march=<march>``) and loaded (once per process),
    or None when it cannot be built or kernels are disabled."""
    key = name if march == "native" else f"{name}:{march}"
    if key in _libraries:
        return _libraries[key]
    with _lock:
        if key in _libraries:
            return _libraries[key]
        library = None
        if not kernels_disabled():
            try:
                library = ctypes.CDLL(str(_build(CSRC / f"{name}.c", march)))
            except (OSError, RuntimeError) as exc:
                logger.warning(
                    "CPU kernels %s unavailable, using the (slower) torch reference: %s",
                    name,
                    exc,
                )
        _libraries[key] = library
    return library
