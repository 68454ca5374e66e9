"""The default L3 model id (``weights_fingerprint``) covers every byte of every parameter and buffer:
checkpoints that differ in one element away from the ends of a tensor (a fine-tune of k_proj in the
middle of the fused qkv_proj) must not share L3 entries, and one set of weights always gets one id."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_core.kvcache.prefix_cache_factory import weights_fingerprint
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


class Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(64, 48, bias=False, dtype=dtype)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(48, 64, generator=g))
        self.register_buffer("bias", torch.randn(2000, generator=g).to(dtype))


def _bump_middle(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.view(-1)[t.numel() // 2] += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy has no bfloat16
def test_one_middle_element_changes_the_fingerprint(dtype):
    a = Tiny(dtype)
    assert weights_fingerprint(a) == weights_fingerprint(copy.deepcopy(a)) == weights_fingerprint(Tiny(dtype))
    b = copy.deepcopy(a)
    _bump_middle(b.proj.weight)
    c = copy.deepcopy(a)
    _bump_middle(c.bias)  # buffers are weights too (e.g. the MoE router's score correction bias)
    assert len({weights_fingerprint(m) for m in (a, b, c)}) == 3


def test_a_strided_tensor_hashes_its_values_in_row_major_order():
    a = Tiny()
    b = copy.deepcopy(a)
    b.proj.weight = torch.nn.Parameter(a.proj.weight.detach().t().contiguous().t())  # column-major
    assert not b.proj.weight.is_contiguous()
    assert weights_fingerprint(a) == weights_fingerprint(b)


def test_the_tiny_model_with_a_fine_tuned_k_proj_is_another_model(tmp_path):
    a = load_model(build_tiny_hf_checkpoint(tmp_path / "hf"), dtype=torch.float32)
    b = copy.deepcopy(a)
    name, qkv = next((n, p) for n, p in b.named_parameters() if "qkv_proj" in n and p.numel() > 1024)
    _bump_middle(qkv)  # far from the first and last 256 elements a sample would read
    assert weights_fingerprint(a) == weights_fingerprint(copy.deepcopy(a))
    assert weights_fingerprint(a) != weights_fingerprint(b), name
