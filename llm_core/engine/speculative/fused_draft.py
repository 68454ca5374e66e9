"""FusedDraft: the k draft steps of mode "first" (MTP layer 0 every step) in one C call, or ~20 ATen calls each.

A draft step is one row per request through one dense layer: at small batches its cost is
dispatches, not math (docs/speculative.md, "What a batch-1 step costs"). The module path
(draft_steps.py) runs the MTPLayer over a ForwardBatch -- ~100 ATen calls per step -- with its KV
store, paged-attention plan and rotary tables. This path runs the same layer from weights folded once
per weight version:

    token table  T[t] = eh_proj_e @ enorm(embed[t])       [V, H]: embed + norm + matmul -> 1 lookup
    W_h          eh_proj_h * hnorm.weight                  hnorm's scale folded into the matmul
    W_qkv        q rows * attention scale, v rows * value_scale
    W_gu         [gate; up] in one matmul
    per draft    R [k, B, D, D]: RoPE at position c_b + s as a matrix (q and k heads in one bmm)

    step s:  x = T[d_s] + rms(h) @ W_h^T          (one addmm)
             qkv = rms(x) @ W_qkv^T ; [q | k] @ R_s ; k, v -> window buffer column W - 1 + s
             attention of 1 query per request over columns s .. W - 1 + s, the sink as an extra logit
             x += o @ W_o^T ; x += down(silu(gate) * up) ; h = final_norm(x) ; d_{s+1} = argmax(lm_head(h))

**RMSNorm as LayerNorm.** ATen's CPU ``rms_norm`` is a composite of ~8 ops (~16 us for one row);
``layer_norm`` is one kernel (~3 us) and equals it on a vector whose mean is 0. So the residual
stream is carried *mirrored*, x~ = [x, -x]: every matrix that writes it has its output columns
doubled with a negated copy, the first half of ``layer_norm(x~, [w; w])`` is ``rms_norm(x) * w``,
and the next matmul reads that half (a view).

**KV.** The window buffer starts with the layer's cached keys/values of positions c - W + 1 .. c - 1
(gathered once, written by the extend; right-aligned, so a request with fewer cached positions has
its left end masked) and takes each step's new column; nothing is stored into the pool: the extend
that follows the verify forward rewrites the MTP KV of positions c .. c + k from the target's hidden
states anyway (proposer.py), so a draft's own KV would be overwritten unread. Requests drafting fewer
than the longest k run the extra steps too (free next to the dispatches) and keep their first k.

**Not bit-identical** to the module path: the folds, the split of ``eh_proj`` into two products and
the mirrored mean (0 up to rounding) change fp32 rounding (~1e-6 relative), so a draft token can
differ where two logits tie that closely. Outputs stay exact whatever the drafts are (verification
decides); acceptance is measured by benchmarks/speculative.py, and
tests/llm_core/engine/test_fused_draft.py requires the module path's tokens on random weights.

**In C** (kernels/native/mtp_draft.c): with the native kernels on (``--no-native-cpu-kernels`` /
``MMSERVE_NATIVE_KERNELS=0`` turn them off), fp32 on the CPU and a token table, all k steps of all B
requests run in one C call over the same folds taken un-mirrored (plain RMSNorm costs nothing there)
and copied into the kernel's layout once per weight version (``_native_kernel``); the window's K/V
are read from the pool through the page tables inside the call. Demo model, batch 1, k = 3: ~0.1 ms
instead of ~0.8 ms (docs/speculative.md, "The draft steps in one C call"). Shapes or dtypes the
kernel cannot take return None from it and the torch steps below run unchanged;
tests/kernels/test_native_mtp_draft.py requires the two paths' tokens to be equal.

The token table is built only while it stays under ``TOKEN_TABLE_MAX_BYTES`` (the demo model's
512 x 2 x 128: 512 KB; MiMo-V2.5's 152k x 2 x 4096 would be 2.5 GB): above that, steps embed and
normalise the token themselves (three calls more).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels import native
from kernels.native.mtp_draft import DraftKernel
from llm_core.model.mtp import MTPLayer

TOKEN_TABLE_MAX_BYTES = 64 << 20


class FusedDraft:
    """Folded weights of MTP layer 0 and a draft's scratch buffers (kept while the batch size stays)."""

    def __init__(self, layer: MTPLayer, embed: torch.nn.Embedding, lm_head: torch.nn.Linear, max_draft: int) -> None:
        attn = layer.self_attn
        if attn.window is None:
            raise ValueError("FusedDraft needs a sliding MTP layer (a bounded window)")
        self.layer, self.embed, self.lm_head, self.max_draft = layer, embed, lm_head, max_draft
        spec = attn.spec
        self.hq, self.hkv, self.d, self.dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
        self.window = attn.window
        self._stamp: tuple = ()
        # the folds' sources as (module parameter dict, name): a parameter replaced or set to None
        # (the sinks) is seen there; the modules themselves are fixed at construction
        l = layer
        mods = (l.enorm, l.hnorm, l.eh_proj, l.input_layernorm, attn.qkv_proj, attn.o_proj, l.pre_mlp_layernorm,
                l.mlp.gate_proj, l.mlp.up_proj, l.mlp.down_proj, l.final_layernorm, embed, lm_head)
        self._param_slots = [(m._parameters, "weight") for m in mods] + [(attn._parameters, "attention_sink_bias")]

    # ---- folded weights ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """(Re)fold the weights when any source parameter was replaced or changed in place. Runs before
        every draft: the parameters are read from the modules' dicts (through nn.Module attribute
        lookups the stamp took ~40 us, a third of a batch-1 C draft; now ~6 us)."""
        stamp = tuple((id(p), -1 if p is None else p._version)
                      for p in (params[name] for params, name in self._param_slots))
        if stamp != self._stamp:
            self._fold()
            self._stamp = stamp
            self._native_kernel()  # the C layouts now too (the proposer refreshes at engine start)

    @torch.no_grad()  # refresh may run outside the engine's inference mode (tests): no autograd graph
    def _fold(self) -> None:
        l, attn = self.layer, self.layer.self_attn
        dtype = l.eh_proj.weight.dtype
        h = l.eh_proj.weight.shape[0]
        w = l.eh_proj.weight.float()
        w_e, w_h = w[:, :h], w[:, h:]

        def mirrored(wt: torch.Tensor) -> torch.Tensor:  # [in, H] -> [in, 2H]: outputs [y, -y]
            return torch.cat([wt, -wt], dim=1).to(dtype).contiguous()

        def doubled(norm) -> torch.Tensor:
            return torch.cat([norm.weight, norm.weight]).to(dtype)

        self.eps = l.hnorm.eps  # every norm of an MTPLayer is built with the config's rms_norm_eps
        vocab = self.embed.weight.shape[0]
        self.table = None
        if vocab * 2 * h * self.embed.weight.element_size() <= TOKEN_TABLE_MAX_BYTES:
            self.table = mirrored(F.linear(l.enorm(self.embed.weight).float(), w_e))  # [V, 2H]
        self.w_e = mirrored(w_e.t())  # used only without the table
        self.w_h = mirrored((w_h * l.hnorm.weight.float()[None, :]).t())
        q, k = attn.spec.q_size, attn.spec.k_size
        qkv = attn.qkv_proj.weight.float().clone()
        qkv[:q] *= attn.scale
        qkv[q + k:] *= attn.value_scale
        self.w_qkv = qkv.to(dtype).t().contiguous()
        self.w_o = mirrored(attn.o_proj.weight.float().t())
        self.inter = l.mlp.gate_proj.weight.shape[0]
        self.w_gu = torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]).t().contiguous()
        self.w_down = mirrored(l.mlp.down_proj.weight.float().t())
        self.norm_in, self.norm_mlp = doubled(l.input_layernorm), doubled(l.pre_mlp_layernorm)
        self.norm_final = doubled(l.final_layernorm)
        sinks = attn.attention_sink_bias
        self.sinks = None if sinks is None else sinks.detach().to(dtype).view(self.hkv, self.hq // self.hkv, 1)
        dev = self.w_qkv.device
        self._batch = 0  # the scratch buffers' batch size (_buffers)
        # RoPE as a matrix: out = x @ R with R[j, j] = cos_j and R[swap(j), j] = signed sin_j, where
        # swap pairs column j with j +- rotary_dim / 2 (rope.py's rotate-half); identity past rotary_dim
        r = attn.rotary.rotary_dim
        swap = torch.zeros(self.d, self.d, dtype=dtype, device=dev)
        j = torch.arange(r, device=dev)
        swap[(j + r // 2) % r, j] = 1.0
        self.swap = swap
        self._cos = self._sin = torch.empty(0, self.d, dtype=dtype, device=dev)
        self._kernel: DraftKernel | None = None  # the C layouts of this weight version, built on first use
        self._kernel_built = False

    def _native_kernel(self) -> DraftKernel | None:
        """This weight version in the C kernel's layout (kernels/native/mtp_draft.py: un-mirrored, no
        torch dispatch per step), or None where the torch steps serve: kernels off, not fp32 CPU, or
        no token table (the C steps look tokens up in it)."""
        if (not native.enabled() or self.table is None or self.w_qkv.dtype is not torch.float32
                or not self.w_qkv.is_cpu):
            return None
        if not self._kernel_built:
            h, attn = self.table.shape[1] // 2, self.layer.self_attn
            kernel = DraftKernel(
                {"table": self.table[:, :h], "w_h": self.w_h[:, :h], "norm_in": self.norm_in[:h], "w_qkv": self.w_qkv,
                 "w_o": self.w_o[:, :h], "norm_mlp": self.norm_mlp[:h], "w_gu": self.w_gu, "w_down": self.w_down[:, :h],
                 "norm_final": self.norm_final[:h], "lm_head": self.lm_head.weight.detach().t(),
                 "sinks": None if self.sinks is None else self.sinks.reshape(-1)},
                num_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d, v_head_dim=self.dv,
                rotary_dim=attn.rotary.rotary_dim, window=self.window, eps=self.eps)
            self._kernel, self._kernel_built = (kernel if kernel.fits else None), True
        return self._kernel

    def _grow_tables(self, end: int) -> None:
        """cos / signed sin [P, D] of the layer's own rotary tables for positions 0 .. P - 1 >= end - 1
        (P = 2^m, grown by doubling; padded past rotary_dim with cos 1, sin 0)."""
        if end > self._cos.shape[0]:
            size = 1 << max(end - 1, 63).bit_length()
            rot = self.layer.self_attn.rotary
            cos, sin = rot.tables(torch.arange(size, device=self.swap.device), self.swap.dtype)
            pad = self.d - rot.rotary_dim
            self._cos = F.pad(cos[:, 0], (0, pad), value=1.0)
            self._sin = F.pad(sin[:, 0], (0, pad), value=0.0)

    def _rotations(self, positions: list[int], k: int) -> torch.Tensor:
        """R [k, B, D, D] for positions[b] + s, s < k (cos/sin from :meth:`_grow_tables`)."""
        self._grow_tables(max(positions) + k)
        if len(positions) == 1:  # one request: its rows are a slice of the tables
            c = positions[0]
            cos, sin = self._cos[c:c + k, None], self._sin[c:c + k, None]
        else:
            at = torch.tensor(positions, device=self.swap.device)[None, :] + torch.arange(k, device=self.swap.device)[:, None]
            cos, sin = self._cos[at], self._sin[at]
        return torch.diag_embed(cos).add_(self.swap * sin[..., None, :])

    def _buffers(self, batch: int) -> None:
        """Scratch for ``batch`` requests, kept while the batch size stays (head-major, so a window of
        every request's heads is one [B * Hkv, n, D] view):

            k_buf[b, :, i]   i = 0 .. W - 2: keys of positions c_b - W + 1 .. c_b - 1 (right-aligned:
                             a request with fewer cached positions leaves the left end masked)
                             i = W - 1 + s: draft step s's key (position c_b + s)
        """
        if batch == self._batch:
            return
        rows, dtype, dev = self.window - 1 + self.max_draft, self.w_qkv.dtype, self.w_qkv.device
        self.k_buf = torch.empty(batch, self.hkv, rows, self.d, dtype=dtype, device=dev)
        self.v_buf = torch.empty(batch, self.hkv, rows, self.dv, dtype=dtype, device=dev)
        self.tokens = torch.empty(self.max_draft, batch, dtype=torch.long, device=dev)
        self.sinks_b = None if self.sinks is None else self.sinks.repeat(batch, 1, 1)
        self._batch = batch

    # ---- the draft --------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, tokens: list[int], positions: list[int], h_prev: torch.Tensor, swa_pages: list[list[int]],
              page_size: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k: int) -> list[list[int]]:
        """k greedy draft tokens for each request b after ``tokens[b]`` (its pending token, at
        ``positions[b]``), from the final-normed hidden states ``h_prev`` [B, H] of the positions
        before; ``swa_pages[b]`` map request b's positions to SWA-pool pages (this layer's cached keys
        of its last W - 1 positions are read)."""
        if not 0 < k <= self.max_draft:
            raise ValueError(f"draft length {k} outside 1..{self.max_draft}")
        if min(positions) < 1:
            raise ValueError("a draft needs at least one computed position before the pending token")
        self.refresh()
        batch, w = len(tokens), self.window
        self._buffers(batch)
        kernel = self._native_kernel()
        if kernel is not None:  # all k steps in one C call (kernels/native/mtp_draft.c)
            self._grow_tables(max(positions) + k)
            h = h_prev if h_prev.is_contiguous() else h_prev.contiguous()
            drafted = kernel.draft(tokens, positions, h, swa_pages, page_size,
                                   k_cache, v_cache, self._cos, self._sin, self.k_buf, self.v_buf, k)
            if drafted is not None:
                return drafted
        cached = [min(c, w - 1) for c in positions]  # positions c - W + 1 .. c - 1 that exist
        most = max(cached)
        lo = w - 1 - most  # buffer columns left of lo hold nothing for any request
        if most:
            slots = []
            for c, n, pages in zip(positions, cached, swa_pages):
                for p in range(c - most, c):  # p < 0: padding, re-reads position c - 1 (masked)
                    p = p if p >= c - n else c - 1
                    page = pages[p // page_size]
                    if page < 0:
                        raise RuntimeError(f"MTP draft reads position {p} whose SWA page was released")
                    slots.append(page * page_size + p % page_size)
            idx = torch.tensor(slots, device=k_cache.device)
            kk = k_cache.index_select(0, idx).view(batch, most, self.hkv, self.d)
            vv = v_cache.index_select(0, idx).view(batch, most, self.hkv, self.dv)
            self.k_buf[:, :, lo:w - 1].copy_(kk.transpose(1, 2))
            self.v_buf[:, :, lo:w - 1].copy_(vv.transpose(1, 2))
        mask = None
        if min(cached) < most:  # [B, 1, columns]: -inf left of each request's first cached column
            cols = torch.arange(w - 1 + self.max_draft, device=k_cache.device)
            first = torch.tensor([w - 1 - n for n in cached], device=k_cache.device)
            mask = torch.zeros(batch, 1, cols.shape[0], dtype=self.w_qkv.dtype, device=k_cache.device)
            mask.masked_fill_((cols[None, :] < first[:, None])[:, None, :], float("-inf"))
        rot = self._rotations(positions, k)  # [k, B, D, D]
        hq, hkv, d, dv, eps, inter = self.hq, self.hkv, self.d, self.dv, self.eps, self.inter
        nqk, group = hq + hkv, hq // hkv
        h = h_prev.to(self.w_h.dtype).view(batch, -1)
        width = 2 * h.shape[1]
        half = width // 2
        h = torch.cat([h, -h], dim=1)  # mirrored, like the residual stream (see the module docstring)
        first_ids = None if batch == 1 and self.table is not None else torch.tensor(tokens, device=k_cache.device)
        for s in range(k):
            ids = self.tokens[s - 1] if s else first_ids
            if self.table is not None:  # one request's first token is a host int: a slice, not a lookup
                e = self.table.index_select(0, ids) if ids is not None else self.table[tokens[0]:tokens[0] + 1]
            else:
                e = torch.mm(self.layer.enorm(self.embed(ids)), self.w_e)
            x = torch.addmm(e, F.layer_norm(h, (width,), None, None, eps)[:, :half], self.w_h)
            qkv = torch.mm(F.layer_norm(x, (width,), self.norm_in, None, eps)[:, :half], self.w_qkv)
            qk = torch.bmm(qkv[:, : nqk * d].view(batch, nqk, d), rot[s])  # q (scaled) and k heads, rotated
            col = w - 1 + s
            self.k_buf[:, :, col].copy_(qk[:, hq:])
            self.v_buf[:, :, col].copy_(qkv[:, nqk * d:].view(batch, hkv, dv))
            a = max(s, lo)  # the query at c + s sees columns s .. W - 1 + s
            keys = self.k_buf[:, :, a:col + 1].reshape(batch * hkv, col + 1 - a, d)  # a view (head-major)
            scores = torch.bmm(qk[:, :hq].reshape(batch * hkv, group, d), keys.transpose(1, 2))
            if mask is not None:
                scores = scores.view(batch, hkv * group, -1).add_(mask[..., a:col + 1]).view(batch * hkv, group, -1)
            if self.sinks_b is not None:  # a sink joins the softmax's denominator only
                probs = torch.softmax(torch.cat([self.sinks_b, scores], -1), -1)[..., 1:]
            else:
                probs = torch.softmax(scores, -1)
            o = torch.bmm(probs, self.v_buf[:, :, a:col + 1].reshape(batch * hkv, col + 1 - a, dv))
            x = x.addmm_(o.view(batch, hq * dv), self.w_o)
            gu = torch.mm(F.layer_norm(x, (width,), self.norm_mlp, None, eps)[:, :half], self.w_gu)
            x = x.addmm_(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), self.w_down)
            h = F.layer_norm(x, (width,), self.norm_final, None, eps)
            torch.argmax(F.linear(h[:, :half], self.lm_head.weight), -1, out=self.tokens[s])
        return self.tokens[:k].T.tolist()
