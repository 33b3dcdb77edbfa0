"""Where the wgmma GEMM's time goes (diagnosis, not a result): each GEMM of the routed FFN
(kimi-k2.7, 4096 tokens/rank, EP=2, uniform) timed alone, normal vs. 'no loads after the
prologue' (MMA + barrier bound) vs. 'no MMAs' (load bound), for a few tiles.

    python3 benchmarks/probe_wgmma.py [--out probe.json]
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (median, numba_stream, padded_layout, progress,  # noqa: E402
                               routing_counts, table, time_iters, write_json)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_wgmma.json")
    ap.add_argument("--tiles", default="256:4,128:4,128:6")
    args = ap.parse_args(argv)
    import torch

    from mok_core.config import preset
    from mok_core.cuda_compat import as_device_array, launch, multiprocessor_count
    from mok_core.grouped_gemm_wgmma_kernels import BM, make_wgmma_grouped_gemm
    shape = preset("kimi-k2.7", ep_size=2)
    H, I, E_l = shape.hidden, shape.intermediate, shape.num_experts // 2
    rng = np.random.default_rng(0)
    counts = routing_counts(rng, 2 * 4096, shape.num_experts, shape.topk, "uniform")[0][:E_l]
    off = padded_layout(counts, BM)
    C = int(off[-1])
    a_index = np.full(C, -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for e in range(E_l):
        a_index[off[e]:off[e] + counts[e]] = np.arange(starts[e], starts[e + 1])
    dev, bf, u16 = "cuda", torch.bfloat16, torch.uint16
    x = torch.randn(int(counts.sum()), H, device=dev, dtype=bf)
    wg = torch.randn(E_l, I, H, device=dev, dtype=bf) * H ** -0.5
    wu = torch.randn(E_l, I, H, device=dev, dtype=bf) * H ** -0.5
    wd = torch.randn(E_l, H, I, device=dev, dtype=bf) * I ** -0.5
    idx = torch.from_numpy(a_index).to(dev)
    d_off = torch.from_numpy(off).to(dev)
    nr = torch.tensor([C], dtype=torch.int32, device=dev)
    hidden = torch.zeros(C, I, device=dev, dtype=bf)
    y = torch.empty(C, H, device=dev, dtype=bf)
    s = numba_stream()
    sms = multiprocessor_count()
    real = float(counts.sum())
    rows = []
    for spec in args.tiles.split(","):
        bn, stages = map(int, spec.split(":"))
        for probe in (0, 1, 2):
            for name in ("gate_up", "down"):
                swi = name == "gate_up"
                k = make_wgmma_grouped_gemm(bn, stages, swi, swi, True, probe=probe)
                N = I if swi else H
                K = H if swi else I
                tiles = (C // BM) * (N // (bn // 2 if swi else bn))
                a = x if swi else hidden
                w0, w1 = (wg, wu) if swi else (wd, wd)
                outv = hidden if swi else y

                kargs = (as_device_array(a.view(u16).reshape(-1), "a"), as_device_array(idx, "i"),
                         as_device_array(w0.view(u16).reshape(-1), "w0"),
                         as_device_array(w1.view(u16).reshape(-1), "w1"),
                         as_device_array(d_off, "off"), as_device_array(nr, "nr"),
                         as_device_array(outv.view(u16).reshape(-1).view(torch.uint32), "out"),
                         np.int64(K), np.int64(N), np.int64(N), np.float32(math.inf))

                def run():
                    launch(k, min(sms, tiles), 256, s, k.smem_bytes, *kargs)
                ms = median(time_iters(run, 10))
                rows.append({"bn": bn, "stages": stages, "probe": probe, "gemm": name, "ms": ms,
                             "tflops_real": 2.0 * real * N * K * (2 if swi else 1) / ms / 1e9})
                progress(f"bn={bn} stages={stages} probe={probe} {name}: {ms:.3f} ms")
    write_json(args.out, rows)
    print(table(rows, ["bn", "stages", "probe", "gemm", "ms", "tflops_real"]))


if __name__ == "__main__":
    main()
