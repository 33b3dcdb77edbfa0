"""int64 top-k ids (what routers produce) -> the int32 the schedule reads, on the device.
Values outside int32 become INT32_MIN so the schedule still flags them as out of range."""
from numba import cuda, int32

from mok_core.cuda_compat import kjit


@kjit
def ids_to_int32_kernel(ids64, ids32):
    i = cuda.grid(1)
    while i < ids64.shape[0]:
        v = ids64[i]
        ids32[i] = int32(v) if -2147483648 <= v <= 2147483647 else int32(-2147483648)
        i += cuda.gridsize(1)
