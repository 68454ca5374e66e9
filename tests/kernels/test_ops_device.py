"""Triton launches follow the tensors' GPU (kernels/ops.py ``on_device``): Triton, CUDA-graph capture
and replay run on torch's *current* device, so each Triton op makes its first tensor's device
current for the launch when it is not. Checked without a GPU: torch.cuda's current device and its
``device`` context are stood in for, and a stand-in Triton module records the device current at
each launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import ops


class _Devices:
    """torch.cuda.current_device / torch.cuda.device stand-ins over one 'current' index."""

    def __init__(self) -> None:
        self.current = 0
        self.switches = 0

    def current_device(self) -> int:
        return self.current

    def device(self, dev: torch.device):
        outer = self

        class _Ctx:
            def __enter__(self):
                self.prev, outer.current = outer.current, dev.index
                outer.switches += 1

            def __exit__(self, *exc):
                outer.current = self.prev

        return _Ctx()


def _gpu_tensor(index: int):
    t = SimpleNamespace(device=torch.device("cuda", index), is_cuda=True)
    t.contiguous = lambda: t
    return t


OPS = {
    "paged_attention": lambda t: ops.paged_attention(t, t, t, t, t, t, page_size=16, scale=1.0),
    "store_kv": lambda t: ops.store_kv(t, t, t, t, t),
    "gather_slots": lambda t: ops.gather_slots(t, t),
    "scatter_slots": lambda t: ops.scatter_slots(t, t, t),
    "fused_experts": lambda t: ops.fused_experts(t, t, t, t, t),
    "band_attention": lambda t: ops.band_attention(t, t, t, t, scale=1.0),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("index", [0, 1])
def test_every_triton_op_launches_on_its_tensors_device(monkeypatch, op, index):
    devices = _Devices()
    monkeypatch.setattr(torch.cuda, "current_device", devices.current_device)
    monkeypatch.setattr(torch.cuda, "device", devices.device)
    launched = []
    kernels = SimpleNamespace()
    for name in ("paged_attention_triton", "store_kv_triton", "gather_slots_triton", "scatter_slots_triton",
                 "fused_experts_triton", "band_attention_triton"):
        setattr(kernels, name, lambda *a, **k: launched.append(devices.current))
    monkeypatch.setattr(ops, "_kernels_for", lambda t, name: kernels)
    OPS[op](_gpu_tensor(index))
    assert launched == [index]  # the tensors' GPU was current at the launch
    assert devices.current == 0  # and the thread's own current device is back afterwards
    assert devices.switches == (index != 0)  # no switch when it already was (the one-GPU case)

