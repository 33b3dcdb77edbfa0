"""Device side of the error word: reset it on the stream (no host copy, graph-capturable) and
record a bounded wait that expired."""
import numpy as np
from numba import cuda

from . import errors as err
from .cuda_compat import SIM, device_full, kjit, launch

_SCRATCH = {}


@kjit
def _reset_kernel(word):
    i = cuda.threadIdx.x
    if i < word.shape[0]:
        v = 0
        if i == err.BAD_ID_MAX:
            v = err.INT32_MIN
        elif i == err.BAD_ID_MIN:
            v = err.INT32_MAX
        elif i == err.TIMEOUT_PEER:
            v = -1
        word[i] = v


def reset_error_word(word, stream=0) -> None:
    """Clear a device error word (``errors.initial_error_word`` values) on ``stream``."""
    if SIM:
        word[...] = err.initial_error_word()
        return
    launch(_reset_kernel, 1, err.ERROR_WORDS, stream, 0, word)


def scratch_error_word():
    """This device's error word that nobody reads: where a kernel that always checks reports
    what its caller already counted elsewhere (one production path, no flag to skip the
    check)."""
    key = 0 if SIM else cuda.get_current_device().id
    if key not in _SCRATCH:
        _SCRATCH[key] = device_full((err.ERROR_WORDS,), 0, np.int32)
    return _SCRATCH[key]


@kjit(device=True)
def record_timeout(errors, rank, counter, expected, seen, peer):
    """One thread: flag a spin-wait timeout with what it waited for (``errors.describe`` names
    the counter via ``COUNTER_NAMES``); the host raises ``MoKError`` at the next check. The
    first timeout recorded wins: later ones only find the flag set."""
    old = cuda.atomic.or_(errors, err.FLAGS, err.ERR_SPIN_TIMEOUT)
    if old & err.ERR_SPIN_TIMEOUT:
        return          # the first timeout's fields stay whole (many threads may expire at once)
    errors[err.TIMEOUT_RANK] = rank
    errors[err.TIMEOUT_COUNTER] = counter
    errors[err.TIMEOUT_EXPECTED] = expected
    errors[err.TIMEOUT_SEEN] = seen
    errors[err.TIMEOUT_PEER] = peer
