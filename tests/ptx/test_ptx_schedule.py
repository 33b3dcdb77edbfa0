"""Schedule kernels (and the FP8 weight gradient's row layout) type-check and lower for sm_90
(no GPU needed)."""
import pytest
from numba import int32, types

import mok_core.errors_kernels as ek
import mok_core.schedule_kernels as sk
import mok_core.wgrad_rows as wr
from ptx_util import compile_sm90

a1, a2, a3 = int32[::1], int32[:, ::1], int32[:, :, ::1]
i64 = types.int64

CASES = {
    "count_routes": (sk.count_routes_kernel, (a3, a1, a3, a1, a1, a1, a1, a1, a1)),
    "scan_chunks": (sk.scan_chunks_kernel, (a3, a3, a2)),
    "expert_offsets": (sk.expert_offsets_kernel, (a2, i64, i64, i64, i64, a1, a2, a1, a1)),
    "place_routes": (sk.place_routes_kernel,
                     (a3, a1, i64, i64, a3, a2, a2, a1, a1, a1, a3, i64, a1)),
    "reset_error_word": (ek._reset_kernel, (a1,)),
    "token_rows": (sk.token_rows_kernel, (i64, i64, a1, a1, a1)),
    "wgrad_rows": (wr.wgrad_rows_kernel, (a1, a1, a1, a1, a1, a1, a1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_for_sm90(name):
    kernel, sig = CASES[name]
    ptx = compile_sm90(kernel, sig)
    # Global integer atomics only where only totals matter (histograms): no order-dependent
    # placement anywhere.
    assert "atom.global.add" not in ptx or name in ("count_routes", "place_routes")
