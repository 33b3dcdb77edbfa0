"""The packed weight layout: each box contiguous and pre-swizzled, and unpacking inverts it."""
import numpy as np
import pytest

from mok_core.grouped_gemm import GemmConfig
from mok_core.weight_pack import SLICE, box_rows, pack_weights, unpack_weights


def test_box_is_contiguous_and_swizzled():
    rng = np.random.default_rng(0)
    E, N, K, rows = 2, 64, 3 * SLICE, 32
    w = rng.integers(0, 1 << 16, (E, N, K), dtype=np.uint16)
    p = pack_weights(w, rows)
    assert p.shape == w.shape and p.dtype == w.dtype
    flat = p.reshape(-1)
    for tile in range(E * N // rows):
        e, row0 = divmod(tile * rows, N)
        for s in range(K // SLICE):
            start = tile * rows * K + s * rows * SLICE        # what the kernel's bulk copy reads
            box = flat[start:start + rows * SLICE].reshape(rows, 8, 8)
            for r in range(rows):
                src = w[e, row0 + r, s * SLICE:(s + 1) * SLICE].reshape(8, 8)
                np.testing.assert_array_equal(box[r], src[np.arange(8) ^ (r % 8)])
    np.testing.assert_array_equal(unpack_weights(p, rows), w)


def test_torch_packing_equals_numpy():
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(1).integers(0, 1 << 15, (3, 16, 2 * SLICE), dtype=np.int16)
    t = pack_weights(torch.from_numpy(w), 8)
    np.testing.assert_array_equal(t.numpy(), pack_weights(w, 8))
    np.testing.assert_array_equal(unpack_weights(t, 8).numpy(), w)


def test_box_rows_follow_the_tile_and_bad_shapes_are_refused():
    cfg = GemmConfig(bm=192, bn=256, bk=64, wm=3, wn=1, stages=4, mma="wgmma", tma=True,
                     packed_weights=True)
    assert (box_rows(cfg, True), box_rows(cfg, False)) == (128, 256)
    with pytest.raises(ValueError, match="multiple"):
        pack_weights(np.zeros((1, 100, 64), np.uint16), 32)
    with pytest.raises(ValueError, match="multiple"):
        pack_weights(np.zeros((1, 64, 96), np.uint16), 32)
    with pytest.raises(ValueError, match="packed_weights"):
        GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=4, mma="wgmma",
                   packed_weights=True)
