"""Shared by the CPU (emulated ranks) and GPU comm tests: inputs, identity expert, reference."""
import ml_dtypes
import numpy as np

from numba import cuda

from mok_comm.emulation import barrier_all
from mok_comm.heap import EmulatedHeap
from mok_comm.workspace import create_workspace
from mok_core.config import MoKConfig
from mok_core.cuda_compat import kjit


def bf16_bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits_f32(b):
    return (np.asarray(b, np.uint32) << 16).view(np.float32)


def make_routing(rng, R, T, k, E, skew=0.0, masked=0.0, empty_ranks=()):
    """[R, T, k] int32: distinct experts per token; ``skew`` of routes go to rank 0's experts."""
    ids = np.empty((R, T, k), np.int64)
    hot = max(1, E // R)
    for r in range(R):
        for t in range(T):
            if rng.random() < skew:
                pool = rng.permutation(hot) if hot >= k else rng.permutation(E)
            else:
                pool = rng.permutation(E)
            ids[r, t] = pool[:k]
    ids[rng.random(ids.shape) < masked] = -1
    for r in empty_ranks:
        ids[r] = -1
    return ids.astype(np.int32)


def reference_round_trip(x_bits, ids, weights, y_shared_bits):
    """out[r, t] = y_shared + sum_j w_j * x[r, t] over unmasked j, float32 with each multiply
    and add rounded (the epilogue's order), then bf16. x_bits [R, T, H] uint16."""
    x = bits_f32(x_bits)
    acc = bits_f32(y_shared_bits).astype(np.float32)
    R, T, k = ids.shape
    for j in range(k):
        live = (ids[:, :, j] >= 0)[..., None]
        prod = (weights[:, :, j][..., None].astype(np.float32) * x).astype(np.float32)
        acc = np.where(live, (acc + prod).astype(np.float32), acc)
    return bf16_bits(acc)


@kjit
def identity_expert_kernel(x_recv, index, num_rows, y, H):
    """y[row] = x_recv[index[row]] (zeros on padding): dispatch -> 'expert' -> combine."""
    i = cuda.grid(1)
    while i < num_rows[0] * H:
        row = i // H
        src = index[row]
        y[i] = x_recv[src * H + i % H] if src >= 0 else 0
        i += cuda.gridsize(1)


class EmulatedGroup:
    """Comm workspaces of R emulated ranks sharing one heap (the comm protocol without a layer)."""

    def __init__(self, ep_size: int, *, tokens_per_rank: int, hidden: int, topk: int,
                 num_experts: int, config: MoKConfig, stream=0):
        self.heap = EmulatedHeap(ep_size, stream)
        self.stream = stream
        self.workspaces = [
            create_workspace(self.heap.for_rank(r), tokens_per_rank=tokens_per_rank,
                             hidden=hidden, topk=topk, num_experts=num_experts, config=config,
                             stream=stream)
            for r in range(ep_size)]

    @property
    def ep_size(self) -> int:
        return len(self.workspaces)

    def each(self, fn) -> list:
        """Run ``fn(rank, workspace)`` for every rank in order (one phase)."""
        return [fn(r, ws) for r, ws in enumerate(self.workspaces)]

    def barrier(self) -> None:
        barrier_all(self.workspaces, self.stream)

    def check(self) -> None:
        self.each(lambda r, ws: ws.check(self.stream))
