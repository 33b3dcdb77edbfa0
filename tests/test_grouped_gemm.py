"""Grouped expert GEMMs (mma.sync and wgmma kernels) vs float64, on the simulator at tiny shapes.

Ragged experts (including empty ones), gathered A rows with padding, SwiGLU clamp on/off,
rows past num_rows untouched, padding rows exactly zero, bitwise-identical reruns; gate/up's
saved FP32 pre-activations (``pre``) against float64 and against the h they made.
"""
import math

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from helpers import push_route, to_dev
from mok_core.cuda_compat import kjit, to_host
from mok_core.gemm import SIM_GEMM, GemmConfig, down, gate_up_swiglu
from mok_core.gemm.epilogue import swiglu as swiglu_epilogue
from mok_core.intrinsics import pack_bf16x2
from mok_core.reference import swiglu

# Small tiles so the simulator stays quick; the same config runs compiled on a GPU.
CFG = SIM_GEMM
# The wgmma kernel's smallest tiles (two 64-row warpgroups, 64 columns, a 3-slice ring); its
# weight tiles come by TMA and its epilogue is staged in shared memory (the only wgmma path).
WGMMA_CFG = GemmConfig(bm=128, bn=64, bk=64, wm=2, wn=1, stages=3, mma="wgmma")
# 3 warpgroups (WGMMA_192_GEMM's form) and 4 warpgroups (256-row tiles).
WGMMA192_CFG = GemmConfig(bm=192, bn=64, bk=64, wm=3, wn=1, stages=3, mma="wgmma")
WGMMA256_CFG = GemmConfig(bm=256, bn=64, bk=64, wm=4, wn=1, stages=3, mma="wgmma")

POISON = 0xFFFF     # bf16 NaN bits: any row the kernel forgets to write shows up


def bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


def bits(a):
    return bf16(a).view(np.uint16)


def f64(b):
    return np.asarray(b).view(ml_dtypes.bfloat16).astype(np.float64)


def layout(counts, bm, capacity_tiles, rng, n_src):
    padded = [-(-c // bm) * bm for c in counts]
    off = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    C = int(off[-1]) + capacity_tiles * bm
    a_index = np.full(C, -1, np.int32)
    for e, c in enumerate(counts):
        a_index[off[e]:off[e] + c] = rng.integers(0, n_src, c)
    return off, C, a_index


def rel_l1(got, want):
    return np.abs(got - want).sum() / np.abs(want).sum()


# ``pre``: gate/up also saves its FP32 pre-activations (the layer's forward with a backward);
# on in half the mma.sync cases and in a 128-row wgmma case (the wgmma epilogue's pre path is
# one code for every warpgroup count; the GPU suite runs it at the layer's tiles), so both
# specialisations run and the simulator's time stays in bounds.
@pytest.mark.parametrize("cfg,counts,limit,pre", [
    (CFG, [40, 0, 17], None, False), (CFG, [40, 0, 17], 1.5, True),
    (CFG, [5, 33, 0, 1], None, True), (CFG, [5, 33, 0, 1], 1.5, False),
    # wgmma: a half-padding tile (rows 64-127 skipped), an empty expert, a full second tile
    # (blocks take several tiles: the ring wraps, mbarrier phase bits flip, the staging is
    # reused tile after tile; no row past an expert's end or past num_rows written: 150 rows =
    # 128 + a tile whose second warpgroup lies past the expert)
    (WGMMA_CFG, [40, 0, 150], 1.5, True), (WGMMA_CFG, [40, 70], None, False),
    # 3 warpgroups, experts padded to 64 rows: one 64-row tile, an empty expert, a 192 + 128
    # pair (the last warpgroup idle past the expert's end)
    (WGMMA192_CFG, [40, 0, 300], 1.5, False),
    # 256-row tiles: a 64-row tile (3 warpgroups idle), an empty expert, 256 + 64 rows
    (WGMMA256_CFG, [40, 0, 300], None, False),
], ids=["sync-a", "sync-a-clamp-pre", "sync-b-pre", "sync-b-clamp", "wgmma-clamp-pre", "wgmma",
        "wgmma192-clamp", "wgmma256"])
def test_gate_up_swiglu_and_down(cfg, counts, limit, pre):
    # (wgmma at a small K: several tiles per block still reuse every stage; the simulator's
    # big blocks are slow)
    H, I = (64, 32) if cfg.mma == "mma_sync" else (128, 64)
    check_gemms(cfg, counts, limit, H, I, pre)


@kjit
def _swiglu_words(g, u, limit, out):
    """out[i] = the bf16 pair of the epilogue's SwiGLU at g / u elements 2i, 2i + 1."""
    i = cuda.grid(1)
    while i < out.size:
        out[i] = pack_bf16x2(swiglu_epilogue(g[2 * i], u[2 * i], limit),
                             swiglu_epilogue(g[2 * i + 1], u[2 * i + 1], limit))
        i += cuda.gridDim.x * cuda.blockDim.x


def check_pre(gate, up, h, x, wg, wu, off, a_index, limit):
    """The saved pre-activations (host float32 [C, I]): rows past num_rows untouched (NaN),
    padding rows exactly zero, real rows x W^T within FP32 accumulation of exact bf16 products
    (K u |x| |W|^T: far below a bf16 rounding, which the test would see), and bitwise the
    values h was made of (the epilogue's SwiGLU of them, rounded, is h)."""
    live = slice(0, off[-1])
    K = x.shape[1]
    for name, a, w in (("gate", gate, wg), ("up", up, wu)):
        assert np.isnan(a[off[-1]:]).all(), f"{name}: rows past num_rows must not be written"
        pad = a_index[live] < 0
        assert (a[live][pad].view(np.uint32) == 0).all(), f"{name}: padding rows must be +0"
        for e in range(len(off) - 1):
            rows = np.arange(off[e], off[e + 1])
            real = rows[a_index[rows] >= 0]
            xa, we = f64(x[a_index[real]]), f64(w[e])
            err = np.abs(a[real] - xa @ we.T)
            bound = K * 2.0 ** -24 * (np.abs(xa) @ np.abs(we).T) + 1e-30
            assert (err <= bound).all(), (name, e, float((err / bound).max()))
    words = to_dev(np.zeros(a_index.size * gate.shape[1] // 2, np.uint32))
    _swiglu_words[2, 32](to_dev(gate.ravel()), to_dev(up.ravel()),
                         np.float32(math.inf if limit is None else limit), words)
    np.testing.assert_array_equal(to_host(words).view(np.uint16).reshape(gate.shape)[live],
                                  h[live])


def check_gemms(cfg, counts, limit, H, I, save_pre=False):
    """gate_up_swiglu (``save_pre``: with its FP32 pre-activations, ``check_pre``) then down
    with ``cfg`` on random bf16 data (hidden H, intermediate I; experts of ``counts`` rows) vs
    float64; padding, rows past num_rows, a bitwise rerun."""
    rng = np.random.default_rng(len(counts) + (0 if limit is None else 1))
    E, n_src = len(counts), 50
    off, C, a_index = layout(counts, cfg.row_unit, 1, rng, n_src)
    x = bits(rng.standard_normal((n_src, H)))
    wg = bits(rng.standard_normal((E, I, H)) / 8)
    wu = bits(rng.standard_normal((E, I, H)) / 8)
    wd = bits(rng.standard_normal((E, H, I)) / 6)
    num_rows = np.array([off[-1]], np.int32)
    hidden = to_dev(np.full((C, I), POISON, np.uint16))
    pre = tuple(to_dev(np.full((C, I), np.nan, np.float32)) for _ in range(2)) if save_pre \
        else None
    gate_up_swiglu(to_dev(x), to_dev(a_index), to_dev(wg), to_dev(wu),
                   to_dev(off), to_dev(num_rows), hidden, pre=pre, swiglu_limit=limit,
                   config=cfg)
    h = to_host(hidden)
    if save_pre:
        check_pre(to_host(pre[0]), to_host(pre[1]), h, x, wg, wu, off, a_index, limit)

    # float64 reference on the same bf16 inputs
    want = np.zeros((C, I))
    for e in range(E):
        rows = np.arange(off[e], off[e + 1])
        real = rows[a_index[rows] >= 0]
        xa = f64(x[a_index[real]])
        want[real] = swiglu(xa @ f64(wg[e]).T, xa @ f64(wu[e]).T, limit)
    live = slice(0, off[-1])
    assert np.all(h[off[-1]:] == POISON), "rows past num_rows must not be written"
    pad = (a_index[live] < 0)
    assert np.all(h[live][pad] == 0), "padding rows must be exactly zero"
    got = f64(h[live])
    assert np.isfinite(got).all()
    assert rel_l1(got, want[live]) < 5e-3
    # each element: bf16 rounding (2 ulps of its magnitude) + the FP32 GEMMs' and SwiGLU's
    # approximations (far below 2**-14 of the largest)
    assert np.all(np.abs(got - want[live]) <= 2.0 ** -7 * np.abs(want[live])
                  + 2.0 ** -14 * np.abs(want[live]).max())

    y = to_dev(np.full((C, H), POISON, np.uint16))
    down(to_dev(h), to_dev(wd), to_dev(off), to_dev(num_rows), y,
         row_index=to_dev(a_index), config=cfg)
    yh = to_host(y)
    want_y, scale_y = np.zeros((C, H)), np.zeros((C, H))
    for e in range(E):
        rows = slice(off[e], off[e + 1])
        want_y[rows] = f64(h[rows]) @ f64(wd[e]).T
        scale_y[rows] = np.abs(f64(h[rows])) @ np.abs(f64(wd[e])).T
    assert np.all(yh[off[-1]:] == POISON)
    assert np.all(yh[live][pad] == 0)
    assert rel_l1(f64(yh[live]), want_y[live]) < 5e-3
    # each element: bf16 rounding + the FP32 accumulation's error (as test_gemm_dgrad)
    assert np.all(np.abs(f64(yh[live]) - want_y[live]) <= 2.0 ** -7 * np.abs(want_y[live])
                  + 2.0 ** -14 * scale_y[live])

    # deterministic: a rerun is bitwise identical
    y2 = to_dev(np.full((C, H), POISON, np.uint16))
    down(to_dev(h), to_dev(wd), to_dev(off), to_dev(num_rows), y2, config=cfg)
    np.testing.assert_array_equal(to_host(y2), yh)


def test_wgmma_output_needs_16_byte_alignment():
    """The staged epilogue's bulk stores need 16-byte addresses: an output view starting 2
    bytes in is refused on the host, before any launch (gate/up's hidden and down's y)."""
    cfg = WGMMA_CFG
    E, H, I, C = 1, 128, 64, 128
    off = to_dev(np.array([0, C], np.int32))
    nr = to_dev(np.array([C], np.int32))
    x = to_dev(np.zeros((C, H), np.uint16))
    idx = to_dev(np.full(C, -1, np.int32))
    w = to_dev(np.zeros((E, I, H), np.uint16))
    buf = np.zeros(C * I + 8, np.uint16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gate_up_swiglu(x, idx, w, w, off, nr, to_dev(buf[1:C * I + 1].reshape(C, I)),
                       config=cfg)
    with pytest.raises(ValueError, match="16-byte aligned"):
        down(to_dev(np.zeros((C, I), np.uint16)), to_dev(np.zeros((E, H, I), np.uint16)), off,
             nr, to_dev(np.zeros(C * H + 8, np.uint16)[1:C * H + 1].reshape(C, H)), config=cfg)


def test_gate_up_pre_is_checked():
    """``pre`` must be two float32 [C, I] arrays with 8-byte aligned starts (their stores are
    8 bytes): anything else is refused on the host, before any launch."""
    cfg = CFG
    E, H, I, C = 1, 64, 32, cfg.bm
    args = (to_dev(np.zeros((C, H), np.uint16)), to_dev(np.full(C, -1, np.int32)),
            to_dev(np.zeros((E, I, H), np.uint16)), to_dev(np.zeros((E, I, H), np.uint16)),
            to_dev(np.array([0, C], np.int32)), to_dev(np.array([C], np.int32)),
            to_dev(np.zeros((C, I), np.uint16)))
    good = to_dev(np.zeros((C, I), np.float32))
    with pytest.raises(TypeError, match="pre: expected \\(gate, up\\)"):
        gate_up_swiglu(*args, pre=(good,), config=cfg)
    with pytest.raises(TypeError, match=r"pre\[1\] \(up\): expected dtype float32"):
        gate_up_swiglu(*args, pre=(good, to_dev(np.zeros((C, I), np.float64))), config=cfg)
    with pytest.raises(ValueError, match=r"pre\[0\] \(gate\)"):
        gate_up_swiglu(*args, pre=(to_dev(np.zeros((C, I + 2), np.float32)), good),
                       config=cfg)
    off4 = to_dev(np.zeros(C * I + 2, np.float32)[1:C * I + 1].reshape(C, I))
    with pytest.raises(ValueError, match="8-byte aligned start"):
        gate_up_swiglu(*args, pre=(good, off4), config=cfg)


def test_rejects_bad_shapes():
    cfg = CFG
    x = np.zeros((8, 64), np.uint16)
    w = np.zeros((2, 32, 64), np.uint16)
    off = np.array([0, cfg.bm, cfg.bm], np.int32)
    nr = np.array([cfg.bm], np.int32)
    idx = np.zeros(cfg.bm, np.int32)
    hid = np.zeros((cfg.bm, 32), np.uint16)
    with pytest.raises(TypeError, match="x: expected dtype uint16"):
        gate_up_swiglu(to_dev(x.astype(np.float32)), to_dev(idx), to_dev(w), to_dev(w),
                       to_dev(off), to_dev(nr), to_dev(hid), config=cfg)
    with pytest.raises(ValueError, match="w_up"):
        gate_up_swiglu(to_dev(x), to_dev(idx), to_dev(w), to_dev(w[:1]), to_dev(off),
                       to_dev(nr), to_dev(hid), config=cfg)
    with pytest.raises(ValueError, match="expert_offsets"):
        gate_up_swiglu(to_dev(x), to_dev(idx), to_dev(w), to_dev(w), to_dev(off[:2]),
                       to_dev(nr), to_dev(hid), config=cfg)
    with pytest.raises(ValueError, match="swiglu_limit"):
        gate_up_swiglu(to_dev(x), to_dev(idx), to_dev(w), to_dev(w), to_dev(off), to_dev(nr),
                       to_dev(hid), swiglu_limit=-1.0, config=cfg)
    with pytest.raises(ValueError, match="hidden size H=40"):
        gate_up_swiglu(to_dev(np.zeros((8, 40), np.uint16)), to_dev(idx),
                       to_dev(np.zeros((2, 32, 40), np.uint16)),
                       to_dev(np.zeros((2, 32, 40), np.uint16)), to_dev(off), to_dev(nr),
                       to_dev(hid), config=cfg)


@pytest.mark.parametrize("kwargs", [dict(bk=48), dict(bm=40), dict(stages=1),
                                    dict(mma="wgmma_ws"),
                                    dict(mma="wgmma", bm=128, bk=64, wm=2, wn=1, bn=64,
                                         stages=2),
                                    dict(mma="wgmma", bm=256, bk=64, wm=4, wn=1, bn=256),
                                    dict(mma="wgmma", bm=128, bk=64, wm=2, wn=1, bn=96),
                                    dict(wm=8, wn=8, bm=128, bn=128), dict(wm=0),
                                    dict(bm=0, bn=0), dict(bm=-32), dict(bm=32.0),
                                    dict(stages=2.5), dict(blocks_per_sm=0),
                                    dict(max_registers=True)])
def test_gemm_config_validation(kwargs):
    field, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=r"^GemmConfig\(bm="):
        GemmConfig(**kwargs)
    if len(kwargs) == 1 and field not in ("bk", "bm", "stages", "mma") or value in (0, 32.0):
        with pytest.raises(ValueError, match=rf"{field}={value!r} must be an int >= [01]$"):
            GemmConfig(**kwargs)
    numpy_ints = GemmConfig(bm=np.int64(64), bn=np.int32(128), bk=32, wm=2, wn=2, stages=4)
    assert numpy_ints == GemmConfig(bm=64, bn=128, bk=32, wm=2, wn=2, stages=4)
    assert type(numpy_ints.bm) is int


def test_sweep_picks_fastest_tiles_per_preset():
    """bench_ffn's sweep -> per-preset tiles (what bench_layer runs each preset with)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_ffn import fastest_per_preset
    a, b = WGMMA_CFG, GemmConfig(bm=128, bn=128, bk=64, wm=2, wn=1, stages=4, mma="wgmma")
    trial = [{"preset": "kimi-k2.7", "gemm": str(a), "ours_ms": 9.0},
             {"preset": "kimi-k2.7", "gemm": str(b), "ours_ms": 9.5},
             {"preset": "qwen3.5-397b", "gemm": str(a), "ours_ms": 4.6},
             {"preset": "qwen3.5-397b", "gemm": str(b), "ours_ms": 4.1}]
    assert fastest_per_preset(trial) == {"kimi-k2.7": a, "qwen3.5-397b": b}


def test_sweep_picks_each_gemms_fastest_tiles_per_case():
    """bench_ffn's sweep -> per (preset, T) the fastest gate_up and the fastest down, apart."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_ffn import SWEEP, fastest_per_gemm
    assert all(GemmConfig(*spec) for spec in SWEEP)          # every swept spec is valid
    a, b = WGMMA_CFG, WGMMA256_CFG
    row = lambda T, c, gu, dn: {"preset": "glm-5.2", "tokens_per_rank": T, "gemm": str(c),  # noqa
                                "gate_up_ms": gu, "down_ms": dn, "ours_ms": gu + dn}
    trial = [row(4096, a, 4.0, 2.0), row(4096, b, 3.5, 2.5), row(8192, a, 7.0, 3.0),
             row(8192, b, 7.5, 3.5)]
    assert fastest_per_gemm(trial) == {("glm-5.2", 4096): (b, a), ("glm-5.2", 8192): (a, a)}


def test_wgmma_needs_hopper_and_default_follows_the_device(monkeypatch):
    """wgmma exists only on sm_90: a wgmma config on another GPU is a clear error before any
    compile, and the default tiles follow the device (simulator: small mma.sync tiles)."""
    import mok_core.gemm as gg
    from mok_core.gemm import config, sm90
    assert gg.default_gemm() == gg.SIM_GEMM

    class Device:
        compute_capability = (10, 0)
    from numba import cuda
    monkeypatch.setattr(config, "SIM", False)
    monkeypatch.setattr(sm90, "SIM", False)
    monkeypatch.setattr(cuda, "get_current_device", lambda: Device())
    assert gg.default_gemm() == gg.MMA_SYNC_GEMM
    with pytest.raises(ValueError, match="needs a Hopper GPU.*sm_100"):
        sm90._require_arch(gg.WGMMA_GEMM)
    Device.compute_capability = (9, 0)
    assert gg.default_gemm() == gg.WGMMA_GEMM
    sm90._require_arch(gg.WGMMA_GEMM)
    assert gg.WGMMA_GEMM.bm == 128
    # Row tile by the mean rows per expert: 192 where one tile replaces two.
    assert gg.WGMMA_192_GEMM.bm == 192
    for rows, bm in ((64, 128), (112, 128), (112.5, 192), (128, 192), (171, 192), (192, 192),
                     (193, 128), (255, 128), (342, 128), (512, 128)):
        assert gg.default_gemm(rows).bm == bm, rows


@pytest.mark.parametrize("cfg", [WGMMA_CFG, WGMMA192_CFG], ids=["wgmma", "wgmma192"])
def test_down_push_equals_down_then_scatter(cfg):
    """down(push=...) -- the combine fused into the epilogue -- writes each real row's bits
    to its source rank's combine row token * k + slot and nothing else (192-row tiles: the
    idle warpgroups past an expert's end push nothing; each row goes by one bulk store)."""
    rng = np.random.default_rng(11)
    counts, E, H, I, R, T, k = [70, 0, 140, 130], 4, 128, 64, 2, 128, 4
    off, C, a_index = layout(counts, cfg.row_unit, 0, rng, 1)
    real = np.flatnonzero(a_index >= 0)
    src_rank, src_token, src_slot = push_route(rng, real, C, R, T, k)
    h = bits(rng.standard_normal((C, I)))
    h[a_index < 0] = 0
    wd = bits(rng.standard_normal((E, H, I)) / 6)
    nr = np.array([off[-1]], np.int32)
    y = to_dev(np.full((C, H), POISON, np.uint16))
    down(to_dev(h), to_dev(wd), to_dev(off), to_dev(nr), y, row_index=to_dev(a_index),
         config=cfg)
    yh = to_host(y)
    peers = tuple(to_dev(np.full(T * k * H, POISON, np.uint16)) for _ in range(R))
    down(to_dev(h), to_dev(wd), to_dev(off), to_dev(nr), None, row_index=to_dev(a_index),
         push=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot), peers, k), config=cfg)
    want = np.full((R, T * k, H), POISON, np.uint16)
    want[src_rank[real], src_token[real] * k + src_slot[real]] = yh[real]
    got = np.stack([to_host(p).reshape(T * k, H) for p in peers])
    np.testing.assert_array_equal(got, want)


def test_wgmma_launch_limits_are_clear_errors():
    """The wgmma kernel's per-expert tile table: more experts than it holds is an error before
    any launch, not a corrupted table."""
    E, H, I = 513, 64, 64
    off = np.zeros(E + 1, np.int32)
    nr = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="513 experts in one launch"):
        down(to_dev(np.zeros((64, I), np.uint16)), to_dev(np.zeros((E, H, I), np.uint16)),
             to_dev(off), to_dev(nr), to_dev(np.zeros((64, H), np.uint16)), config=WGMMA_CFG)
