"""The matrix-product helper shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_f32(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST (CPU interpreter only) widens the operands
    first: the interpreter keeps bfloat16 as raw uint16 and would multiply bit patterns."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
