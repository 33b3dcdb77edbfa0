"""Grouped expert GEMMs at real shapes on the GPU vs float64 (sampled rows), determinism; gate/up's
saved FP32 pre-activations (``pre``) too."""
import numpy as np
import pytest

from mok_core.reference import swiglu


def f64(t):
    import torch
    return t.float().double().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()


def _configs():
    from mok_core.gemm import MMA_SYNC_GEMM, WGMMA_192_GEMM, WGMMA_GEMM, GemmConfig
    return {"wgmma": WGMMA_GEMM,
            "wgmma192": WGMMA_192_GEMM,
            "wgmma128": GemmConfig(128, 128, 64, 2, 1, 5, mma="wgmma"),
            "wgmma_bm256": GemmConfig(256, 128, 64, 4, 1, 4, mma="wgmma"),
            "wgmma_2blk": GemmConfig(128, 128, 64, 2, 1, 3, 2, mma="wgmma"),
            # 3 stages: the first staging stage is reloaded at the next tile's first K step
            "wgmma_s3": GemmConfig(128, 128, 64, 2, 1, 3, mma="wgmma"),
            "mma_sync": MMA_SYNC_GEMM}


@pytest.mark.parametrize("preset_name", ["kimi-k2.7", "qwen3.5-397b"])
@pytest.mark.parametrize("limit", [None, 4.0])
@pytest.mark.parametrize("cfg_name", ["wgmma", "wgmma192", "wgmma128", "wgmma_bm256",
                                      "wgmma_2blk", "wgmma_s3", "mma_sync"])
def test_gemm_real_shape(dist, preset_name, limit, cfg_name):
    import torch

    from benchmarks.common import numba_stream, padded_layout, routing_counts
    from mok_core.config import preset
    from mok_core.gemm import down, gate_up_swiglu
    cfg = _configs()[cfg_name]
    shape = preset(preset_name, ep_size=2)
    H, I, E, k = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
    E_l, T = E // 2, 4096
    rng = np.random.default_rng(7)
    counts = routing_counts(rng, 2 * T, E, k, "skewed")[0][:E_l]
    counts[3] = 0                                            # an empty expert
    off = padded_layout(counts, cfg.row_unit)
    C = int(off[-1]) + cfg.bm                       # spare rows past num_rows
    n_src = 2 * T
    a_index = np.full(C, -1, np.int32)
    for e in range(E_l):
        a_index[off[e]:off[e] + counts[e]] = rng.integers(0, n_src, counts[e])
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    x = torch.randn(n_src, H, device="cuda", dtype=bf, generator=g) * 2
    wg = torch.randn(E_l, I, H, device="cuda", dtype=bf, generator=g) * H ** -0.5
    wu = torch.randn(E_l, I, H, device="cuda", dtype=bf, generator=g) * H ** -0.5
    wd = torch.randn(E_l, H, I, device="cuda", dtype=bf, generator=g) * I ** -0.5
    d_off = torch.from_numpy(off).cuda()
    d_nr = torch.tensor([off[-1]], dtype=torch.int32, device="cuda")
    d_idx = torch.from_numpy(a_index).cuda()
    u16 = torch.uint16
    s = numba_stream()
    kw = [wg, wu, wd]

    def run(save_pre=True):
        hidden = torch.full((C, I), float("nan"), device="cuda", dtype=bf)
        y = torch.full((C, H), float("nan"), device="cuda", dtype=bf)
        pre = tuple(torch.full((C, I), float("nan"), device="cuda") for _ in range(2)) \
            if save_pre else None
        gate_up_swiglu(x.view(u16), d_idx, kw[0].view(u16), kw[1].view(u16), d_off, d_nr,
                       hidden.view(u16), pre=pre, swiglu_limit=limit, config=cfg, stream=s)
        down(hidden.view(u16), kw[2].view(u16), d_off, d_nr, y.view(u16), row_index=d_idx,
             config=cfg, stream=s)
        torch.cuda.synchronize()
        return hidden, y, pre

    hidden, y, pre = run()
    n = int(off[-1])
    assert torch.isnan(y[n:]).all(), "rows past num_rows must stay untouched"
    assert not torch.isnan(y[:n]).any() and not torch.isnan(hidden[:n]).any()
    pad = torch.from_numpy(a_index[:n] < 0).cuda()
    assert (hidden[:n][pad] == 0).all() and (y[:n][pad] == 0).all()
    for a in pre:                       # the saved g, u: rows as hidden's, padding +0.0
        assert torch.isnan(a[n:]).all() and not torch.isnan(a[:n]).any()
        assert (a[:n][pad].view(torch.int32) == 0).all()

    # float64 on 3 experts (all their rows)
    err_num = err_den = 0.0
    for e in [int(np.argmax(counts)), 1, E_l - 1]:
        rows = np.arange(off[e], off[e] + counts[e])
        if rows.size == 0:
            continue
        xa = f64(x[torch.from_numpy(a_index[rows]).long().cuda()])
        g_ref, u_ref = xa @ f64(wg[e]).T, xa @ f64(wu[e]).T
        h_ref = swiglu(g_ref, u_ref, limit)
        for a, ref in zip(pre, (g_ref, u_ref)):   # FP32 accumulation (bf16 would be ~1e-3)
            err = np.abs(f64(a[rows[0]:rows[-1] + 1]) - ref).sum() / np.abs(ref).sum()
            assert err < 1e-5, f"saved pre-activation, expert {e}: rel-L1 {err}"
        y_ref = f64(hidden[rows[0]:rows[-1] + 1]) @ f64(wd[e]).T     # down from our hidden
        h_err = np.abs(f64(hidden[rows[0]:rows[-1] + 1]) - h_ref).sum() / np.abs(h_ref).sum()
        assert h_err < 5e-3, f"gate_up expert {e}: rel-L1 {h_err}"
        err_num += np.abs(f64(y[rows[0]:rows[-1] + 1]) - y_ref).sum()
        err_den += np.abs(y_ref).sum()
    assert err_num / err_den < 5e-3

    h2, y2, pre2 = run()
    assert torch.equal(h2[:n], hidden[:n]) and torch.equal(y2[:n], y[:n]), "not deterministic"
    assert all(torch.equal(a[:n].view(torch.int32), b[:n].view(torch.int32))
               for a, b in zip(pre, pre2))
    h3, y3, _ = run(save_pre=False)     # saving changes nothing else
    assert torch.equal(h3[:n], hidden[:n]) and torch.equal(y3[:n], y[:n])
