import re

from numba import cuda


def compile_sm90(kernel, sig):
    """PTX of a kjit kernel for sm_90 (raises on any typing/lowering error)."""
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    assert ".target sm_90" in ptx
    return ptx


def count(ptx, pattern):
    return len(re.findall(pattern, ptx))
