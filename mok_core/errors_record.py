"""Device helpers that record a problem's details in an error word (layout: ``mok_core.errors``).

Every helper is order-independent: counts are atomic adds, "first" is the smallest index kept
as the key ``INT32_MAX - index`` under atomic max (``errors.from_key`` reads it back), and
plain stores write a value every caller agrees on (the rank, the limit checked against).
Callers reach them only on the bad path, so the hot path pays nothing but the test that found
the problem (and ``finish_bad_ids``' one atomic per block).
"""
from numba import cuda, int64

from . import errors as err
from .cuda_compat import kjit


@kjit(device=True)
def record_bad_id(errors, rank, num_experts, index):
    """One bad expert id of this rank, at flat index ``index`` = t*k + slot. Its token, slot
    and exact value are filled in by ``finish_bad_ids`` at the end of the launch."""
    cuda.atomic.add(errors, err.BAD_ID_COUNT, 1)
    cuda.atomic.max(errors, err.BAD_ID_FIRST, err.INT32_MAX - index)
    errors[err.BAD_ID_RANK] = rank
    errors[err.BAD_ID_LIMIT] = num_experts
    cuda.atomic.or_(errors, err.FLAGS, err.ERR_BAD_EXPERT_ID)


@kjit(device=True)
def finish_bad_ids(ids, k, errors):
    """Every thread of every block calls it last: the last block to finish writes the token,
    slot and exact int64 value of the first bad id (``ids`` flat, k ids per token), then puts
    the block counter back to 0. Costs one atomic per block."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()                       # our records precede our count
        done = cuda.atomic.add(errors, err.BAD_ID_DONE, 1)
        if done == cuda.gridDim.x - 1:           # every other block has counted: all recorded
            cuda.threadfence()
            errors[err.BAD_ID_DONE] = 0
            key = cuda.atomic.max(errors, err.BAD_ID_FIRST, 0)     # a coherent read
            if key != 0:
                i = err.INT32_MAX - key
                v = int64(ids[i])
                errors[err.BAD_ID_TOKEN] = i // k
                errors[err.BAD_ID_SLOT] = i % k
                # low 32 bits as a signed int32 (no wrap on store), high 32 bits signed
                errors[err.BAD_ID_VALUE_LO] = ((v + 0x80000000) & 0xFFFFFFFF) - 0x80000000
                errors[err.BAD_ID_VALUE_HI] = v >> 32


@kjit(device=True)
def record_non_finite(errors, tensor, rank, count, first_row):
    """``count`` NaN/Inf values of tensor id ``tensor`` (``errors.TENSOR_NAMES``), the smallest
    token (row) among them ``first_row``."""
    cuda.atomic.add(errors, err.NAN_COUNT, count)
    cuda.atomic.add(errors, err.NONFINITE + 2 * tensor, count)
    cuda.atomic.max(errors, err.NONFINITE + 2 * tensor + 1, err.INT32_MAX - first_row)
    errors[err.NONFINITE_RANK] = rank
    cuda.atomic.or_(errors, err.FLAGS, err.ERR_NON_FINITE)


@kjit(device=True)
def record_gemm_non_finite(errors, tensor, rank, count, first_row, expert):
    """``count`` NaN/Inf values in a GEMM's output tile (tensor id ``tensor``), the smallest
    expert-sorted row among them ``first_row``, of local expert ``expert``: one warp's report
    (the epilogue reduces over its lanes first)."""
    record_non_finite(errors, tensor, rank, count, first_row)
    cuda.atomic.max(errors, err.NONFINITE_EXPERT + tensor, err.INT32_MAX - expert)
