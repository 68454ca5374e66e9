"""Row orders of a fused ``qkv_proj`` weight on disk, and the permutation to our plain [Q | K | V].

Our model keeps qkv_proj rows as all q heads, then all k heads, then all v heads. Hub checkpoints
interleave the rows in C chunks, each chunk ``[Q_c | K_c | V_c]`` with an equal share of q heads and
of kv heads:

    disk (C = 4):  | Q_0 K_0 V_0 | Q_1 K_1 V_1 | Q_2 K_2 V_2 | Q_3 K_3 V_3 |
    ours:          | Q_0 Q_1 Q_2 Q_3 | K_0 K_1 K_2 K_3 | V_0 V_1 V_2 V_3 |

Two readings of C exist for MiMo-V2.5 (docs/model.md §2.1, open question 1):

* ``"tp4_chunks"`` (default; sglang, llama.cpp): C = ``config.fused_qkv_chunks`` = the full-attention
  KV head count (4 on the real model), the same for full and sliding layers (SWA: [16 q | 2 k | 2 v]).
* ``"kv_groups"`` (vLLM's newer loader): C = the layer's own KV head count (SWA: [8 q | 1 k | 1 v] x 8).

For full layers of the real model the two coincide; for sliding layers they differ.
"""

from __future__ import annotations

import torch

from llm_core.model.config import AttentionSpec

QKV_ROW_ORDERS = ("tp4_chunks", "kv_groups")


def chunk_count(spec: AttentionSpec, fused_qkv_chunks: int, order: str) -> int:
    """C for one attention kind under a row order; validates that heads split evenly."""
    if order not in QKV_ROW_ORDERS:
        raise ValueError(f"qkv_row_order {order!r}; expected one of {QKV_ROW_ORDERS}")
    chunks = fused_qkv_chunks if order == "tp4_chunks" else spec.num_kv_heads
    if spec.num_heads % chunks or spec.num_kv_heads % chunks:
        raise ValueError(
            f"fused qkv: {spec.num_heads} q heads / {spec.num_kv_heads} kv heads do not split into {chunks} "
            f"chunks (qkv_row_order={order!r})"
        )
    return chunks


def disk_rows_of_plain(spec: AttentionSpec, chunks: int) -> torch.Tensor:
    """perm[i] = disk row holding plain row i, so ``plain = disk[perm]``."""
    q, k, v = spec.q_size, spec.k_size, spec.v_size
    qc, kc, vc = q // chunks, k // chunks, v // chunks
    chunk_rows = qc + kc + vc
    parts = []
    # Plain Q block = the Q parts of chunks 0..C-1 in order, then K parts, then V parts.
    for offset, size in ((0, qc), (qc, kc), (qc + kc, vc)):
        for c in range(chunks):
            start = c * chunk_rows + offset
            parts.append(torch.arange(start, start + size))
    return torch.cat(parts)


def plain_rows_of_disk(spec: AttentionSpec, chunks: int) -> torch.Tensor:
    """Inverse permutation: ``disk = plain[inv]`` (used to write hub-layout checkpoints)."""
    perm = disk_rows_of_plain(spec, chunks)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv
