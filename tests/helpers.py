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
