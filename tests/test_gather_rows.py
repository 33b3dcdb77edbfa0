"""FP8 rows gathered into expert order (``mok_core.gather_rows``): quantising each token once
and gathering its e4m3 row and scales gives the bytes of quantising every route's row
(``quantize_fp8(index=...)``), bit for bit -- repeats, the first and last token, padding rows
(index < 0: zeros, scales 1.0), the rows from num_rows on left as they were, num_rows of 0, < 0
or past the rows -- with more rows than the grid's warps and rows of more than 32 chunks and
32 scales (every stride loop turns twice), on the CUDA simulator in CI and unchanged on a GPU."""
import numpy as np
import pytest

from helpers import to_dev
from mok_core.cuda_compat import SIM, to_host
from mok_core.errors_kernels import scratch_error_word
from mok_core.gather_rows import launch_gather_rows
from mok_core.quantize import launch_quantize_rows, quantize_fp8
from test_quantize import inputs

POISON, POISON_SCALE = 0xAB, -3.0


def gathered_both_ways(tokens, rows, K, cut, seed):
    """(the gathering quantizer's rows and scales, the token quantizer's then gathered), both
    into buffers poisoned first, and the index."""
    rng = np.random.default_rng(seed)
    xb = inputs(seed, tokens, K)
    index = rng.integers(0, tokens, rows).astype(np.int32)
    index[rng.random(rows) < 0.2] = -1                       # padding rows
    index[:5] = [-5, 7 % tokens, 7 % tokens, 0, tokens - 1]  # any negative; a repeat; the ends
    num_rows = to_dev(np.array([cut], np.int32))

    def poisoned():
        return (to_dev(np.full((rows, K), POISON, np.uint8)),
                to_dev(np.full((rows, K // 128), POISON_SCALE, np.float32)))
    want, want_s = poisoned()
    quantize_fp8(to_dev(xb), out=want, scales=want_s, index=to_dev(index), num_rows=num_rows)
    tok = to_dev(np.zeros((tokens, K), np.uint8))
    tok_s = to_dev(np.zeros((tokens, K // 128), np.float32))
    launch_quantize_rows(to_dev(xb), tok, tok_s, errors=scratch_error_word())
    got, got_s = poisoned()
    launch_gather_rows(tok, tok_s, to_dev(index), num_rows, got, got_s, stream=0)
    return (to_host(want), to_host(want_s)), (to_host(got), to_host(got_s)), index


@pytest.mark.parametrize("tokens,rows,K,cut", [
    (40, 300, 256, 291) if SIM else (8192, 81920, 4096, 81911),    # more rows than warps
    (6, 9, 4224, 7) if SIM else (64, 300, 7168, 290),               # 264 chunks, 33 scales
    (6, 9, 256, 0), (6, 9, 256, -3), (6, 9, 256, 50)])              # num_rows 0, < 0, past
def test_tokens_quantised_then_gathered_equal_each_route_quantised(tokens, rows, K, cut):
    (want, want_s), (got, got_s), index = gathered_both_ways(tokens, rows, K, cut, 3 + K)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_s.view(np.uint32), want_s.view(np.uint32))
    n = min(max(cut, 0), rows)
    pad = index[:n] < 0
    assert (got[:n][pad] == 0).all() and (got_s[:n][pad] == 1.0).all()
    assert (got[:n][~pad] != POISON).any() or not (~pad).any()
    assert (got[n:] == POISON).all() and (got_s[n:] == POISON_SCALE).all()
