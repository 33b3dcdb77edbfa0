"""FP8 rows gathered into expert order (``mok_core.gather_rows``): quantising each token once
and gathering its e4m3 row and scales gives the bytes of quantising every route's row
(``quantize_fp8(index=...)``), bit for bit -- repeats, padding rows (index < 0: zeros,
scales 1.0), the rows from num_rows on left as they were -- on the CUDA simulator in CI and
unchanged on a GPU."""
import numpy as np

from helpers import to_dev
from mok_core.cuda_compat import SIM, to_host
from mok_core.errors_kernels import scratch_error_word
from mok_core.gather_rows import launch_gather_rows
from mok_core.quantize import launch_quantize_rows, quantize_fp8
from test_quantize import inputs

TOKENS, ROWS, K = (40, 70, 384) if SIM else (8192, 81920, 4096)


def test_tokens_quantised_then_gathered_equal_each_route_quantised():
    rng = np.random.default_rng(3)
    xb = inputs(31, TOKENS, K)
    index = rng.integers(0, TOKENS, ROWS).astype(np.int32)
    index[rng.random(ROWS) < 0.2] = -1                       # padding rows
    index[:3] = [-5, 7, 7]                                    # any negative; a repeat
    cut = ROWS - 9                                            # num_rows: the rest untouched
    num_rows = to_dev(np.array([cut], np.int32))
    want = to_dev(np.full((ROWS, K), 0xAB, np.uint8))
    want_s = to_dev(np.full((ROWS, K // 128), -3.0, np.float32))
    quantize_fp8(to_dev(xb), out=want, scales=want_s, index=to_dev(index), num_rows=num_rows)
    tok = to_dev(np.zeros((TOKENS, K), np.uint8))
    tok_s = to_dev(np.zeros((TOKENS, K // 128), np.float32))
    launch_quantize_rows(to_dev(xb), tok, tok_s, errors=scratch_error_word())
    got = to_dev(np.full((ROWS, K), 0xAB, np.uint8))
    got_s = to_dev(np.full((ROWS, K // 128), -3.0, np.float32))
    launch_gather_rows(tok, tok_s, to_dev(index), num_rows, got, got_s, stream=0)
    got, got_s, want, want_s = to_host(got), to_host(got_s), to_host(want), to_host(want_s)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_s.view(np.uint32), want_s.view(np.uint32))
    pad = index[:cut] < 0
    assert (got[:cut][pad] == 0).all() and (got_s[:cut][pad] == 1.0).all()
    assert (got[cut:] == 0xAB).all() and (got_s[cut:] == -3.0).all()
