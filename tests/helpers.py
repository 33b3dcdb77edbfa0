"""Small test helpers: move arrays to the device world the suite runs in."""
import numpy as np

from mok_core.cuda_compat import SIM


def to_dev(a):
    """Host array -> what kernels take here (the array itself on the simulator)."""
    a = np.ascontiguousarray(a)
    if SIM:
        return a
    from numba import cuda
    return cuda.to_device(a)


def guarded(n, dtype, fill, guard=64, guard_value=-777):
    """(full buffer, interior view of n elements): a write out of bounds lands in the guards."""
    full = np.full(n + 2 * guard, guard_value, dtype=dtype)
    full[guard:guard + n] = fill
    return full, full[guard:guard + n]


def push_route(rng, real, C, R, T, k):
    """A random push route for the rows ``real`` of C: a unique (rank, token, slot) each, -1
    rank on the others -> (src_rank, src_token, src_slot) int32 [C]."""
    slots = rng.permutation(R * T * k)[:real.size]
    src_rank = np.full(C, -1, np.int32)
    src_token = np.zeros(C, np.int32)
    src_slot = np.zeros(C, np.int32)
    src_rank[real], rem = slots // (T * k), slots % (T * k)
    src_token[real], src_slot[real] = rem // k, rem % k
    return src_rank, src_token, src_slot


def rand_bf16_bits(rng, shape, top):
    """Random bf16 bits, |x| in [2^(top-4), 2^top), random sign and mantissa: built as bits,
    so the operands of a real shape take seconds, not minutes, on the host."""
    r = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    exp = np.uint16(127 + top - 4) + ((r >> 7) & np.uint16(3))
    return (r & np.uint16(0x807F)) | (exp << np.uint16(7))


def gpu_ms(fn, reps, warmup):
    """Mean ms of ``fn`` over ``reps`` calls after ``warmup`` calls (CUDA events)."""
    from numba import cuda
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    t0, t1 = cuda.event(), cuda.event()
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    t1.synchronize()
    return cuda.event_elapsed_time(t0, t1) / reps
