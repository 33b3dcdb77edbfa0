"""MoK-Py demo: the expert-parallel MoE layer forward, checked against float64 and timed.

    make demo

* With GPUs: every local GPU is one EP rank (started through ``mok_comm.launch``), Kimi-K2.7
  shape (H 7168, I 2048, 384 experts, top-8, shared expert), 4096 tokens per rank; checks
  sampled tokens against float64 and prints the per-step time.
* Without: the same kernels on numba's CUDA simulator, 2 ranks emulated in one process, a tiny
  shape; prints the schedule (who pulls what) and the error against the float64 reference.
"""
import os
import subprocess
import sys
import time

GPU = os.path.exists("/dev/nvidia0")
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def simulator_demo() -> int:
    import ml_dtypes
    import numpy as np

    from mok_comm.emulation import emulated_layer, run_phases
    from mok_comm.functional import forward_phases, schedule_phases
    from mok_core.config import LayerShape, MoKConfig
    from mok_core.cuda_compat import to_host
    from mok_core.gemm import SIM_GEMM
    from mok_core.reference import moe_forward

    R, T = 2, 32
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=8,
                       topk=3, ep_size=R)
    cfg = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
    gemm = SIM_GEMM
    rng = np.random.default_rng(0)
    E, k, H, I = shape.num_experts, shape.topk, shape.hidden, shape.intermediate
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    bits = lambda a: np.ascontiguousarray(a.view(np.uint16))  # noqa: E731
    ids = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(T)]) for _ in range(R)])
    ids[rng.random(ids.shape) < 0.1] = -1                          # a few masked routes
    ids = ids.astype(np.int32)
    x = bf(rng.standard_normal((R, T, H)))
    w = rng.random((R, T, k)).astype(np.float32)
    ws = [bf(rng.standard_normal(s) / np.sqrt(s[-1])) for s in
          [(I, H), (I, H), (H, I), (E, I, H), (E, I, H), (E, H, I)]]
    print(f"MoK-Py demo on the CUDA simulator (CPU): EP={R}, {T} tokens/rank, {E} experts, "
          f"top-{k}, H={H}, I={I}, shared expert, rows padded to {cfg.row_align}")
    t0 = time.perf_counter()
    lws = emulated_layer(shape, T, cfg, gemm)
    run_phases([lw.comm for lw in lws], [schedule_phases(lw, ids[r]) for r, lw in enumerate(lws)])
    outs = [np.full((T, H), 0xFFFF, np.uint16) for _ in range(R)]
    E_l = shape.experts_per_rank
    phases = [forward_phases(cfg, lw, lw.schedule, bits(x[r]), w[r], bits(ws[0]), bits(ws[1]),
                             bits(ws[2]), bits(ws[3][r * E_l:(r + 1) * E_l]),
                             bits(ws[4][r * E_l:(r + 1) * E_l]),
                             bits(ws[5][r * E_l:(r + 1) * E_l]), out=outs[r])[0]
              for r, lw in enumerate(lws)]
    run_phases([lw.comm for lw in lws], phases)
    for lw in lws:
        lw.check()
    dt = time.perf_counter() - t0
    for r, lw in enumerate(lws):
        got = lw.schedule.to_host()
        print(f"\nrank {r}: experts {r * E_l}..{(r + 1) * E_l - 1}, {got['num_rows'][0]} padded "
              f"rows of {lw.schedule.capacity}")
        for j in range(E_l):
            per_src = ", ".join(f"{c} from rank {s}" for s, c in
                                enumerate(got["expert_rank_counts"][j]))
            lo, hi = got["expert_offsets"][j], got["expert_offsets"][j + 1]
            print(f"  expert {r * E_l + j}: rows [{lo}, {hi}) <- {per_src}; first sources "
                  f"{got['src_rank'][lo:lo + 6].tolist()}")
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    want = moe_forward(f64(x).reshape(R * T, H), w.reshape(R * T, k), ids.reshape(R * T, k),
                       *(f64(a) for a in ws)).reshape(R, T, H)
    got = np.stack([to_host(o).view(ml_dtypes.bfloat16).astype(np.float64) for o in outs])
    err = np.abs(got - want).sum() / np.abs(want).sum()
    ok = bool(np.isfinite(got).all() and err < 5e-3)
    print(f"\nlayer output vs float64 reference: rel-L1 {err:.2e} (bf16 tolerance 5e-3); "
          f"simulated in {dt:.1f} s")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def gpu_demo() -> int:
    import torch

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_torch import synthetic
    from mok_torch.reference import reference_tokens
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    from numba import cuda
    cuda.select_device(local)
    dev = torch.device("cuda", local)
    T = 4096
    shape = preset("kimi-k2.7", ep_size=world)
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, rank, dev)
    wg, wu, wd = synthetic.local_expert_weights(shape, rank, dev)
    shared = synthetic.shared_weights(shape, dev)
    lw = mok_torch.get_workspace(shape, T, cfg)

    def step():
        sched = mok_torch.build_schedule(lw, ids)
        return mok_torch.forward(cfg, lw, sched, x, w, *shared, wg, wu, wd)[0]

    out = step()
    torch.cuda.synchronize()
    lw.check()
    pick = torch.linspace(0, T - 1, 16, device=dev).long()
    ref = reference_tokens(x[pick], ids[pick], w[pick], shared,
                           lambda e: synthetic.expert_weights(shape, e, dev))
    err = float((out[pick].double() - ref).abs().sum() / ref.abs().sum())
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    ok = err < 5e-3
    print(f"[rank {rank}/{world}] kimi-k2.7, {T} tokens/rank, EP={world}: rel-L1 vs float64 "
          f"(16 sampled tokens) {err:.2e}, step (schedule + forward) {ms:.2f} ms -> "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    torch.cuda.synchronize()
    lw.comm.free()
    return 0 if ok else 1


def main() -> int:
    if not GPU or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return simulator_demo()
    if "RANK" not in os.environ:
        import torch
        n = torch.cuda.device_count()
        if n > 1:                     # one process per GPU through our own launcher
            return subprocess.call([sys.executable, "-m", "mok_comm.launch", "--nproc", str(n),
                                    "--", sys.executable, "-m", "examples.demo"])
    return gpu_demo()


if __name__ == "__main__":
    sys.exit(main())
