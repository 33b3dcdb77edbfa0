"""bf16 <-> float32 device helpers over uint16 / packed-uint32 bits (fp32 math everywhere)."""
from numba import uint32

from .cuda_compat import kjit
from .intrinsics import u32_as_f32


@kjit(device=True, inline="always")
def lo_bf16(word):
    """Low bf16 of a packed uint32 pair -> float32."""
    return u32_as_f32(uint32(uint32(word) << uint32(16)))


@kjit(device=True, inline="always")
def hi_bf16(word):
    """High bf16 of a packed uint32 pair -> float32."""
    return u32_as_f32(uint32(uint32(word) & uint32(0xFFFF0000)))


@kjit(device=True, inline="always")
def nonfinite_bf16x2(word):
    """How many of the two bf16 in a packed uint32 are NaN or Inf (exponent all ones)."""
    n = 0
    if (uint32(word) & uint32(0x7F80)) == uint32(0x7F80):
        n += 1
    if (uint32(word) & uint32(0x7F800000)) == uint32(0x7F800000):
        n += 1
    return n
