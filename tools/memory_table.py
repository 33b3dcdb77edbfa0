"""The layer's device memory per rank at the model presets: README's memory table.

    python tools/memory_table.py            # the table, printed
    python tools/memory_table.py --write    # rewrite README.md between the memory-table markers
    python tools/memory_table.py --check    # exit 1 when README.md's table is not what the code says

Each row is ``Layer.nbytes`` summed (the buffers a layer allocates once: symmetric staging and
combine rows, expert-sorted rows, backward buffers; not the caller's weights, gradients or
inputs) for a Hopper layer as ``mok_torch.Layer`` builds it by default -- ``MoKConfig()``,
whose capacity holds every route of every rank landing on one rank, and the tiles
``default_gemm`` picks on an H100/H200. The layers are built on the CUDA simulator over a heap
that allocates without touching memory, so this runs anywhere in a second or two.
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.report import readme_table, table  # noqa: E402
from mok_comm.heap import Heap  # noqa: E402
from mok_comm import layer as layer_module  # noqa: E402
from mok_comm.layer import Layer  # noqa: E402
from mok_core.config import MoKConfig, preset  # noqa: E402
from mok_core.gemm.config import hopper_gemm  # noqa: E402

BEGIN, END = "<!-- memory-table -->", "<!-- /memory-table -->"
PRESETS = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b", "deepseek-v4-pro")
EP_SIZES = (1, 2, 8)


class _SizingHeap(Heap):
    """Rank 0 of ``ep_size`` ranks, its symmetric buffers uninitialised and every peer view the
    same array: sizes only (nothing runs on these layers)."""

    def __init__(self, ep_size: int):
        self.ep_size, self.rank = ep_size, 0

    def alloc(self, shape, dtype, fill=0, *, name=None, dims=None):
        arr = np.empty(shape, dtype)
        return arr, (arr,) * self.ep_size


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def layer_bytes(name: str, ep: int, tokens: int, backward: bool) -> dict:
    shape = preset(name, ep)
    gemm = hopper_gemm(layer_module.rows_per_expert(shape, tokens))
    # the backward's tiles as on Hopper: on the simulator (it cannot run wgmma) the layer
    # picks mma.sync ones, whose d_x GEMM cannot push its rows home and so holds d_x_rows
    with mock.patch.object(layer_module, "SIM", False):
        layer = Layer(shape, tokens, MoKConfig(), heap=_SizingHeap(ep), gemm=gemm,
                      verify=False, backward=backward)
    return layer.nbytes


def block(tokens: int) -> str:
    head = ["preset", "EP", "forward only GiB", "forward + backward GiB",
            "largest buffers (GiB, with the backward)"]
    rows = []
    for name in PRESETS:
        for ep in EP_SIZES:
            fwd = sum(layer_bytes(name, ep, tokens, False).values())
            both = layer_bytes(name, ep, tokens, True)
            top = sorted(both.items(), key=lambda kv: -kv[1])[:3]
            rows.append([name, str(ep), gib(fwd), gib(sum(both.values())),
                         ", ".join(f"{k.replace(' (symmetric)', '')} {gib(v)}" for k, v in top)])
    return table(head, rows) + (
        f"\n\nPer rank at {tokens} tokens/rank, bf16, `MoKConfig()` defaults (the capacity holds "
        "every route of every rank on one rank: no overflow at any routing); about linear in "
        "`tokens_per_rank`; the weights and their gradients are the caller's. "
        "`layer.nbytes` lists a layer's buffers; `python tools/memory_table.py` prints this "
        "table from it.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite README.md's memory table")
    mode.add_argument("--check", action="store_true", help="fail if README.md's table is stale")
    a = ap.parse_args(argv)
    return readme_table(block(a.tokens), a.write, a.check, BEGIN, END,
                        "memory table differs from Layer.nbytes",
                        "python tools/memory_table.py --write")

if __name__ == "__main__":
    sys.exit(main())
