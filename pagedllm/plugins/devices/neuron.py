"""AWS Inferentia/Trainium through torch-neuronx (detected only; no model runner yet)."""

from __future__ import annotations

import glob
import importlib.util
from typing import Any

from pagedllm.core.interfaces import Device


class NeuronDevice(Device):
    name = "neuron"
    priority = 70
    runs_models = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_neuronx") is None:
            return "torch-neuronx is not installed"
        if not glob.glob("/dev/neuron*"):
            return "no Neuron device is present (/dev/neuron* not found)"
        return None

    def torch_device(self):
        import torch_xla.core.xla_model as xm

        return xm.xla_device()

    def memory_info(self) -> tuple[int, int]:
        # Neuron cores expose no free-memory query through torch; the engine refuses
        # this device before asking (runs_models is False).
        raise RuntimeError("pagedllm cannot size a KV cache on Neuron devices yet")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "devices": sorted(glob.glob("/dev/neuron*"))}
