"""Fixes for gaps of triton 3.6's CPU interpreter that our kernels hit (tests only: the shipped
kernels never run under the interpreter)."""

from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Fix two gaps of triton 3.6's CPU interpreter that our kernels hit. Idempotent.

    * numpy >= 2.4 (triton-lang/triton#9171): scalars are 1-element arrays turned into Python ints
      with ``int(array)``, which numpy 2.4 rejects -- any ``range(lo, hi)`` with a loaded bound fails.
    * bfloat16 ``tl.dot`` (triton-lang/triton#11584): bf16 is stored as uint16 and the dot multiplies
      the raw bit patterns. We widen bf16 operands to fp32 first (exact: bf16 is fp32's top half).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_mmserve_fixed", False):
        return

    def patch_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patch_tensor._mmserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_tensor
    interpreter.InterpreterBuilder.create_dot = create_dot
