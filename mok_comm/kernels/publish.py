"""Publish this rank's tokens: copy x into its slice of the symmetric staging buffer (where peers
pull it from) and count non-finite values on the way -- the NaN/Inf check costs no extra pass.
Router weights are checked in the same launch. A non-finite value sets ERR_NON_FINITE and the
count in the error word (the host raises on ``check``); the data is still copied."""
import math

from numba import cuda

from mok_core import errors as err
from mok_core.bf16 import nonfinite_bf16x2
from mok_core.cuda_compat import kjit
from mok_core.intrinsics import ld_v4, st_v4


@kjit
def publish_x_kernel(x, x_buf, weights, errors):
    """Launch: any grid. x, x_buf uint16 [T*H] (H % 8 == 0); weights float32 [T*k]."""
    bad = 0
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.shape[0] // 8:
        a, b, c, d = ld_v4(x, i * 8)
        st_v4(x_buf, i * 8, a, b, c, d)
        bad += nonfinite_bf16x2(a) + nonfinite_bf16x2(b) + nonfinite_bf16x2(c) \
            + nonfinite_bf16x2(d)
        i += stride
    i = cuda.grid(1)
    while i < weights.shape[0]:
        if not math.isfinite(weights[i]):
            bad += 1
        i += stride
    if bad:
        cuda.atomic.add(errors, err.NAN_COUNT, bad)
        cuda.atomic.or_(errors, err.FLAGS, err.ERR_NON_FINITE)
