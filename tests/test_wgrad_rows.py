"""The FP8 weight gradient's row layout (``mok_core.wgrad_rows``) against its numpy statement:
each expert's rows in use from a multiple of 128, their source rows and tokens, -1 elsewhere."""
import numpy as np
import pytest

from helpers import to_dev
from mok_core.cuda_compat import device_full, to_host
from mok_core.wgrad_rows import k_capacity, launch_wgrad_rows, wgrad_rows_reference


@pytest.mark.parametrize("row_align,counts,cut", [
    (32, [40, 0, 200, 1, 0, 128, 97], 0),        # empty experts, ragged, one of 128 exactly
    (32, [40, 0, 200, 1, 0, 128, 97], 150),      # num_rows inside the third expert
    (64, [0, 0, 0], 0),                          # no rows at all
    (128, [130, 5, 256], 0),                     # the schedule's own layout again
    (32, [31] * 300, 0)])                        # more experts than a block's threads
def test_wgrad_rows_matches_its_reference(row_align, counts, cut):
    rng = np.random.default_rng(len(counts) + cut)
    padded = [-(-n // row_align) * row_align for n in counts]
    off = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    C = max(int(off[-1]), row_align)
    nr = np.array([int(off[-1]) - cut], np.int32)
    gather = np.full(C, -1, np.int32)
    for e, n in enumerate(counts):               # real rows gather tokens, padding -1
        gather[off[e]:off[e] + n] = rng.integers(0, 1000, n)
    K = k_capacity(C, len(counts), row_align)
    outs = [device_full((len(counts) + 1,), 7, np.int32), device_full((1,), 7, np.int32),
            device_full((K,), 7, np.int32), device_full((K,), 7, np.int32)]
    launch_wgrad_rows(to_dev(off), to_dev(nr), to_dev(gather), *outs)
    want = wgrad_rows_reference(off, nr, gather, K)
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(to_host(got), w)
    k_off = want[0]
    assert (k_off % 128 == 0).all() and k_off[-1] <= K
    if row_align == 128 and not cut:
        np.testing.assert_array_equal(k_off, off)


def test_k_capacity_bounds_every_routing():
    """K holds the layout whatever the counts: each expert grows by <= 128 - row_align."""
    rng = np.random.default_rng(5)
    for row_align in (16, 32, 64, 128, 256):
        for _ in range(50):
            E = int(rng.integers(1, 40))
            counts = rng.integers(0, 300, E) * (rng.random(E) < 0.8)
            padded = -(-counts // row_align) * row_align
            C = int(padded.sum()) + row_align * int(rng.integers(0, 3))
            need = int((-(-counts // 128) * 128).sum())
            assert need <= k_capacity(C, E, row_align)
            assert k_capacity(C, E, row_align) % 128 == 0
