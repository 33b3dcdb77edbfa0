"""MoK-Py demo: build the pull schedule for 2 emulated ranks and run the reference layer.

    make demo

On a machine without a GPU it runs the real schedule kernels under numba's CUDA simulator at a
tiny shape; with GPUs it runs the same kernels on the first GPU. It prints, for each rank, what
its experts receive and from whom, checks the kernels against the NumPy reference, and runs the
float64 reference MoE layer forward + backward on the concatenated tokens.
"""
import os
import sys
import time

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402

from mok_core import reference as ref  # noqa: E402
from mok_core.config import LayerShape, MoKConfig  # noqa: E402
from mok_core.cuda_compat import SIM  # noqa: E402
from mok_core.schedule import Schedule, build_schedule, build_schedule_numpy  # noqa: E402


def main() -> int:
    R, T = 2, 48
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=8, topk=3,
                       ep_size=R)
    cfg = MoKConfig(row_align=8, minibatch_size=32, macrobatch_size=128)
    rng = np.random.default_rng(0)
    E, k = shape.num_experts, shape.topk
    ids = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(T)]) for _ in range(R)])
    ids[rng.random(ids.shape) < 0.1] = -1                         # a few masked routes
    ids = np.ascontiguousarray(ids.astype(np.int32))
    where = "CUDA simulator (CPU)" if SIM else "GPU"
    print(f"MoK-Py demo on the {where}: EP={R}, {T} tokens/rank, {E} experts, top-{k}, "
          f"rows padded to {cfg.row_align}")

    ok = True
    for rank in range(R):
        s = Schedule.allocate(rank=rank, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                              config=cfg)
        dev_ids = ids
        if not SIM:
            from numba import cuda
            dev_ids = cuda.to_device(ids)
        t0 = time.perf_counter()
        build_schedule(s, dev_ids)
        got = s.to_host()
        dt = time.perf_counter() - t0
        s.check()
        want = build_schedule_numpy(ids, rank, shape.experts_per_rank, s.capacity, cfg.row_align,
                                    minibatch_size=cfg.minibatch_size)
        same = all(np.array_equal(got[n], want[n]) for n in want)
        ok &= same
        print(f"\nrank {rank}: experts {rank * shape.experts_per_rank}.."
              f"{(rank + 1) * shape.experts_per_rank - 1}, {got['num_rows'][0]} padded rows of "
              f"{s.capacity} capacity, schedule built in {dt * 1e3:.0f} ms, "
              f"matches reference: {same}")
        for j in range(shape.experts_per_rank):
            per_src = ", ".join(f"{c} from rank {r}" for r, c in
                                enumerate(got["expert_rank_counts"][j]))
            lo, hi = got["expert_offsets"][j], got["expert_offsets"][j + 1]
            print(f"  expert {rank * shape.experts_per_rank + j}: rows [{lo}, {hi}) <- {per_src}; "
                  f"first sources {got['src_rank'][lo:lo + 6].tolist()}")

    # The layer math on all ranks' tokens (what the EP layer must reproduce).
    N, H, I = R * T, shape.hidden, shape.intermediate
    x = rng.standard_normal((N, H))
    w = rng.random((N, k))
    ws = [rng.standard_normal(s_) / np.sqrt(s_[-1]) for s_ in
          [(I, H), (I, H), (H, I), (E, I, H), (E, I, H), (E, H, I)]]
    out = ref.moe_forward(x, w, ids.reshape(N, k), *ws, swiglu_limit=4.0)
    grads = ref.moe_backward(rng.standard_normal((N, H)), x, w, ids.reshape(N, k), *ws,
                             swiglu_limit=4.0)
    print(f"\nreference layer (float64): out {out.shape}, |out| mean {np.abs(out).mean():.4f}; "
          f"grads: " + ", ".join(f"{n} {tuple(g.shape)}" for n, g in zip(grads._fields, grads)))
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
