"""Tile configuration of the grouped GEMMs, its presets and the default choice.

``GemmConfig`` holds only what a user may tune; everything is compile-time for the kernels and
validated here, once. ``mma`` picks the kernel: ``"mma_sync"`` (``sm80``: any sm_80+ GPU and
the simulator) or ``"wgmma"`` (``sm90``: Hopper only; TMA weight tiles and the staged
shared-memory epilogue always). ``default_gemm`` picks per device and expected rows per
expert; the reasons for the presets are measured (see docs/perf.md).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..cuda_compat import SIM, multiprocessor_count
from . import sm90

MMA_KINDS = ("mma_sync", "wgmma")


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of the grouped GEMMs (all compile-time).

    bm x bn output tile per block (bn counts gate+up columns for the SwiGLU GEMM), bk the K
    slice, wm x wn warps, ``stages`` slices in flight, ``blocks_per_sm`` persistent blocks per
    SM (wgmma: also launch bounds, so ptxas caps registers to fit them), ``max_registers`` a
    register cap (0: the compiler's choice).

    ``"wgmma"``: wm = bm / 64 warpgroups of 64 rows, wn = 1, bk = 64 (the 128-byte swizzle
    row), bn in {64, 128, 256}, bm in {128, 192, 256} (256 needs bn <= 128), stages >= 3, and
    the staged output tile must fit in two ring stages. ``row_unit``: what expert segments
    must be padded to (``MoKConfig.row_align`` a multiple of it): bm for mma.sync, 64 for
    wgmma (a tile is up to bm rows of one expert).
    """
    bm: int = 128
    bn: int = 128
    bk: int = 32
    wm: int = 2
    wn: int = 4
    stages: int = 4
    blocks_per_sm: int = 1
    max_registers: int = 0
    mma: str = "mma_sync"

    def __post_init__(self):
        def req(cond, msg):
            if not cond:
                raise ValueError(f"{self}: {msg}")
        for f in ("bm", "bn", "bk", "wm", "wn", "stages", "blocks_per_sm", "max_registers"):
            v, low = getattr(self, f), 0 if f == "max_registers" else 1
            req(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low,
                f"{f}={v!r} must be an int >= {low}")
            object.__setattr__(self, f, int(v))      # (a NumPy int: the kernels' constants)
        req(self.mma in MMA_KINDS, f"mma must be one of {MMA_KINDS}")
        req(self.max_registers == 0 or 32 <= self.max_registers <= 255,
            "max_registers must be 0 or in [32, 255]")
        if self.mma == "wgmma":
            req((self.bk, self.wn) == (64, 1) and self.bm in (128, 192, 256)
                and self.wm == self.bm // 64,
                "wgmma tiles are bm=128, 192 or 256, bk=64, wm=bm/64 (warpgroups), wn=1")
            req(self.bm < 256 or self.bn <= 128, "bm=256 (4 warpgroups) needs bn <= 128")
            req(self.bn in (64, 128, 256), "wgmma bn must be 64, 128 or 256")
            req(self.stages >= 3, "wgmma needs stages >= 3")
            req(self.bm * (2 * self.bn + 16) <= 2 * (self.bm + self.bn) * 128,
                "the staged output tile must fit in two ring stages")
        else:
            req(self.bk in (32, 64), "bk must be 32 or 64")
            req(self.bm % (self.wm * 16) == 0, "bm must be a multiple of 16*wm")
            req(self.bn % (self.wn * 16) == 0, "bn must be a multiple of 16*wn")
            req(self.stages >= 2, "stages must be >= 2")
            threads = self.wm * self.wn * 32
            req(threads <= 1024, "too many warps")
            req((self.bm * self.bk // 8) % threads == 0
                and (self.bn * self.bk // 8) % threads == 0,
                "tile chunks must divide evenly over threads")
        req(self.smem_bytes <= 227 * 1024, "shared memory over 227 KiB")

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32 if self.mma == "mma_sync" else 2 * self.bm

    @property
    def smem_bytes(self) -> int:
        if self.mma == "wgmma":
            return sm90.smem_bytes(self.bn, self.stages, self.bm)
        return (self.bm + self.bn) * self.bk * 2 * self.stages

    @property
    def row_unit(self) -> int:
        """Expert segments must be padded to a multiple of this many rows."""
        return self.bm if self.mma == "mma_sync" else sm90.ROW_UNIT

    def grid(self, rows: int, n: int, n_tile: int) -> int:
        """Persistent grid: one block per SM (x blocks_per_sm), never more than the tiles that
        ``rows`` rows x ``n`` columns can hold."""
        tiles = (rows // self.row_unit) * (n // n_tile)       # an upper bound on the tiles
        return max(1, min(tiles, multiprocessor_count() * self.blocks_per_sm))


# Hopper: 2 warpgroups x 64 rows. The default where experts hold up to 112 or over 192 rows.
WGMMA_GEMM = GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=4, mma="wgmma")
# Hopper, 3 warpgroups: an expert of <= 192 rows reads its weights once (one row tile instead
# of two).
WGMMA_192_GEMM = GemmConfig(bm=192, bn=256, bk=64, wm=3, wn=1, stages=4, mma="wgmma")
# Mean rows per expert above which one 192-row tile beats 128-row tiles: the per-expert count
# of a routing scatters around the mean (~sqrt(mean) for uniform routing), so from here on a
# good share of experts holds > 128 rows and would take two 128-row tiles (two weight reads).
ROWS_FOR_192 = 112
MMA_SYNC_GEMM = GemmConfig(bm=64, bn=128, bk=32, wm=2, wn=2, stages=4, blocks_per_sm=2)
SIM_GEMM = GemmConfig(bm=32, bn=32, bk=32, wm=2, wn=1, stages=2)


def default_gemm(rows_per_expert: float | None = None) -> GemmConfig:
    """The tiles used when a caller passes none: wgmma on Hopper (sm_90 -- wgmma exists only
    there), mma.sync on other GPUs (sm_80+), small mma.sync tiles on the simulator. Asks the
    current device, so call it where a CUDA context exists (at launch or workspace creation).

    ``rows_per_expert`` (the expected mean, e.g. R*T*k/E for a layer) picks the Hopper row
    tile: weight traffic from L2 bounds these GEMMs and every row tile of an expert reads its
    weights once, so ``WGMMA_192_GEMM`` for a mean in (``ROWS_FOR_192``, 192] rows (one tile
    instead of two for most experts: half the weight reads), else ``WGMMA_GEMM`` (128 rows;
    also without a hint). Where 192 saves less (3 tiles instead of 4, 2 instead of 3) 128
    wins or ties (see docs/perf.md)."""
    if SIM:
        return SIM_GEMM
    from numba import cuda
    if cuda.get_current_device().compute_capability != (9, 0):
        return MMA_SYNC_GEMM
    return hopper_gemm(rows_per_expert)


def hopper_gemm(rows_per_expert: float | None = None) -> GemmConfig:
    """``default_gemm``'s choice on Hopper (its docstring), whatever device is current."""
    if rows_per_expert is not None and ROWS_FOR_192 < rows_per_expert <= 192:
        return WGMMA_192_GEMM
    return WGMMA_GEMM
