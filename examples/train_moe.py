"""Train a small language model whose decoder block uses ``mok_torch.MoEBlock``, beside the same
model built on the torch-native EP layer, and compare their loss curves and step times.

    torchrun --standalone --nproc-per-node=2 examples/train_moe.py          # 2 GPUs, EP 2
    python -m mok_comm.launch --nproc 2 -- python examples/train_moe.py     # the same
    python examples/train_moe.py                                            # 1 GPU, or the
                                                                            # CUDA simulator
    python examples/train_moe.py --precision fp8      # our block in FP8 (MoKConfig.precision)
The model: token embedding -> one pre-norm decoder block (causal attention from torch, then a
DeepSeek-V3-style MoE: sigmoid router with an aux-free bias, a shared expert, routed experts
sharded over the EP ranks) -> norm -> LM head. The data: sequences of a random Markov chain
(each token has a few likely successors), different on every rank, so the loss falls from
ln(vocab) toward the chain's entropy. Both models start from the same parameters and see the
same batches; each step runs both, in turns (alternating which goes first), AdamW on each.
Replicated parameters (everything but the routed experts) get their gradients summed over the
ranks -- the data-parallel all-reduce a trainer does; the routed experts' gradients are complete
on their owner already.

Prints a progress bar (loss and step time of both), then the loss curves' gap and both step
times; writes the curves as PNG (``--plot``). Exits 1 if our loss does not fall or does not track
the reference's within ``--tolerance`` (mean relative gap over the last tenth of the steps).
Without a GPU: numba's CUDA simulator, a tiny shape, EP 1, a few steps. ``--precision fp8``:
our block in FP8 (it quantises its routed weights after each optimizer step) against the same
torch-native block in bf16 -- the loss curves show what FP8 costs in training.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time

GPU = os.path.exists("/dev/nvidia0")
if not GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np                                            # noqa: E402
import torch                                                  # noqa: E402
import torch.distributed as dist                              # noqa: E402
from torch import nn                                          # noqa: E402

import mok_torch                                              # noqa: E402
from mok_core.config import MoKConfig                         # noqa: E402
from mok_testing.torch_native import TorchNativeEP            # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from png_plot import plot                                     # noqa: E402

SHAPES = {   # a DeepSeek-V3-like block, scaled down; and the simulator's tiny one
    "gpu": dict(hidden=2048, heads=16, intermediate=1024, shared=1024, experts=64, topk=8,
                vocab=4096, seq=1024, batch=4, steps=300, lr=1e-3),
    "sim": dict(hidden=64, heads=2, intermediate=32, shared=32, experts=4, topk=2, vocab=64,
                seq=16, batch=1, steps=6, lr=3e-3),
    "sim-fp8": dict(hidden=128, heads=2, intermediate=128, shared=128, experts=4, topk=2,
                    vocab=64, seq=32, batch=1, steps=6, lr=3e-3),     # FP8: multiples of 128
}


class Attention(nn.Module):
    def __init__(self, hidden, heads, **bf):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **bf)
        self.out = nn.Linear(hidden, hidden, bias=False, **bf)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(B, S, H))


class LM(nn.Module):
    def __init__(self, s, moe: nn.Module, **bf):
        super().__init__()
        self.embed = nn.Embedding(s["vocab"], s["hidden"], **bf)
        self.norm1 = nn.RMSNorm(s["hidden"], **bf)
        self.attn = Attention(s["hidden"], s["heads"], **bf)
        self.norm2 = nn.RMSNorm(s["hidden"], **bf)
        self.moe = moe
        self.norm = nn.RMSNorm(s["hidden"], **bf)
        self.head = nn.Linear(s["hidden"], s["vocab"], bias=False, **bf)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x))
        x = x + self.moe(self.norm2(x))
        return self.head(self.norm(x))


class NativeMoE(nn.Module):
    """The same MoE on the torch-native EP layer (``mok_testing.torch_native``: NCCL
    all_to_all with host-synced splits, ``torch._grouped_mm``, torch autograd), starting from
    ``block``'s parameters; the routed gate|up stacked as a framework holds them."""

    def __init__(self, block: mok_torch.MoEBlock):
        super().__init__()
        import copy
        self.router = copy.deepcopy(block.router)
        p = lambda t: nn.Parameter(t.detach().clone())     # noqa: E731
        self.w_shared_gate, self.w_shared_up = p(block.w_shared_gate), p(block.w_shared_up)
        self.w_shared_down = p(block.w_shared_down)
        self.w_gu = p(torch.cat([block.w_gate, block.w_up], 1))
        self.w_down = p(block.w_down)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        ids, w = self.router(h)
        layer = TorchNativeEP.concatenated(
            (self.w_shared_gate, self.w_shared_up, self.w_shared_down), self.w_gu, self.w_down)
        return layer.forward(h, ids, w.float()).reshape(x.shape)


def markov_batches(s, steps, rank, seed=0):
    """[steps, batch, seq + 1] int64 token sequences of this rank (numpy: the same everywhere)."""
    V = s["vocab"]
    chain = np.random.default_rng(seed)
    successors = chain.integers(0, V, (V, 4))
    rng = np.random.default_rng([seed, rank])
    n = steps * s["batch"]
    seqs = np.empty((n, s["seq"] + 1), np.int64)
    seqs[:, 0] = rng.integers(0, V, n)
    for i in range(1, s["seq"] + 1):
        seqs[:, i] = successors[seqs[:, i - 1], rng.integers(0, 4, n)]
    return torch.from_numpy(seqs.reshape(steps, s["batch"], -1))


def init_distributed():
    """torchrun's or mok_comm.launch's environment; else a world of one (the reference layer
    needs a process group)."""
    backend = "nccl" if GPU else "gloo"
    if "RANK" in os.environ:
        if GPU:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        if GPU:
            torch.cuda.set_device(0)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    return dist.get_rank(), dist.get_world_size()


class Timer:
    def __init__(self):
        self.times = []

    def __enter__(self):
        if GPU:
            self.start, self.end = torch.cuda.Event(True), torch.cuda.Event(True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if GPU:
            self.end.record()
            self.times.append((self.start, self.end))
        else:
            self.times.append(time.perf_counter() - self.t0)

    def ms(self, skip: int) -> float:
        """Median step time past the first ``skip`` steps (warm-up), in ms."""
        if GPU:
            torch.cuda.synchronize()
            t = [a.elapsed_time(b) for a, b in self.times]
        else:
            t = [1e3 * s for s in self.times]
        t = t[skip:] or t
        return float(np.median(t))


def main() -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                     help="our layer's MoKConfig.precision (the torch-native one stays bf16)")
    precision = pre.parse_known_args()[0].precision
    s = dict(SHAPES["gpu" if GPU else "sim-fp8" if precision == "fp8" else "sim"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    ap.add_argument("--steps", type=int, default=s["steps"])
    ap.add_argument("--batch", type=int, default=s["batch"], help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=s["seq"])
    ap.add_argument("--lr", type=float, default=s["lr"])
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--plot", default="train_moe_loss.png")
    args = ap.parse_args()
    s.update(batch=args.batch, seq=args.seq)
    rank, R = init_distributed()
    dev = torch.device("cuda", torch.cuda.current_device()) if GPU else torch.device("cpu")
    bf = dict(device=dev, dtype=torch.bfloat16)
    T = s["batch"] * s["seq"]
    kw = dict(config=MoKConfig(precision=precision)) if GPU else dict(
        config=MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0,
                         precision=precision),
        gemm=__import__("mok_core.gemm", fromlist=["SIM_GEMM"]).SIM_GEMM)
    torch.manual_seed(0)                   # equal replicated parameters on every rank
    ours = LM(s, mok_torch.MoEBlock(s["hidden"], s["intermediate"], s["shared"], s["experts"],
                                    s["topk"], max_tokens=T, **kw), **bf)
    ref = LM(s, NativeMoE(ours.moe), **bf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not name.startswith("moe."):
                p.copy_(ours.get_parameter(name))
    models = {"MoK-Py": ours, "torch-native EP": ref}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01)
            for n, m in models.items()}
    experts = {"moe.w_gate", "moe.w_up", "moe.w_down", "moe.w_gu"}
    replicated = {n: [p for name, p in m.named_parameters() if name not in experts]
                  for n, m in models.items()}
    batches = markov_batches(s, args.steps, rank)
    losses = {n: [] for n in models}
    timers = {n: Timer() for n in models}
    if rank == 0:
        print(f"MoK-Py training example ({precision}): EP {R}, {T} tokens/rank/step, "
              f"H {s['hidden']}, "
              f"{s['experts']} experts top-{s['topk']}, I {s['intermediate']}, shared "
              f"{s['shared']}, vocab {s['vocab']}, {args.steps} steps"
              f"{'' if GPU else ' (CUDA simulator)'}", flush=True)
    for step in range(args.steps):
        data = batches[step].to(dev)
        inp, tgt = data[:, :-1], data[:, 1:]
        order = list(models) if step % 2 == 0 else list(models)[::-1]
        for name in order:
            model, opt = models[name], opts[name]
            with timers[name]:
                opt.zero_grad(set_to_none=True)
                logits = model(inp)
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, s["vocab"]),
                                                   tgt.reshape(-1))
                (loss / R).backward()
                for p in replicated[name]:
                    if R > 1:
                        dist.all_reduce(p.grad)
                opt.step()
            losses[name].append(loss.detach())
        if rank == 0 and (step % 10 == 9 or step == args.steps - 1 or not GPU):
            done = (step + 1) / args.steps
            now = {n: float(v[-1]) for n, v in losses.items()}
            print(f"\r[{'#' * int(30 * done):<30}] {step + 1}/{args.steps}  loss "
                  f"{now['MoK-Py']:.3f} (torch-native {now['torch-native EP']:.3f})  "
                  f"{timers['MoK-Py'].ms(3):.1f} ms/step (torch-native "
                  f"{timers['torch-native EP'].ms(3):.1f})", end="" if GPU else "\n",
                  flush=True)
    curves = {}
    for name, v in losses.items():
        t = torch.stack(v)
        if R > 1:
            dist.all_reduce(t)
        curves[name] = (t / R).tolist()                    # the global mean loss per step
    ms = {n: t.ms(min(5, args.steps // 5)) for n, t in timers.items()}
    ok = True
    if rank == 0:
        a, b = curves["MoK-Py"], curves["torch-native EP"]
        tail = max(1, args.steps // 10)
        gap = float(np.mean([abs(x - y) / y for x, y in zip(a[-tail:], b[-tail:])]))
        fell = np.mean(a[-tail:]) < a[0] - 0.1 * (a[0] - math.log(4))
        ok = fell and gap <= args.tolerance
        plot(args.plot, f"loss EP {R} {T} tokens/rank", "step",
             {"MoK-Py": (list(range(1, len(a) + 1)), a),
              "torch-native EP": (list(range(1, len(b) + 1)), b)})
        print(f"\nloss {a[0]:.3f} -> {np.mean(a[-tail:]):.3f} (torch-native {b[0]:.3f} -> "
              f"{np.mean(b[-tail:]):.3f}); mean gap over the last {tail} steps "
              f"{100 * gap:.2f}% (tolerance {100 * args.tolerance:.0f}%): "
              f"{'tracks' if ok else 'FAILS'}")
        print(f"step time (median, fwd+bwd+optimizer): MoK-Py {ms['MoK-Py']:.2f} ms, "
              f"torch-native EP {ms['torch-native EP']:.2f} ms "
              f"({ms['torch-native EP'] / ms['MoK-Py']:.2f}x); plot: {args.plot}")
    ours.moe.layer.check()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
