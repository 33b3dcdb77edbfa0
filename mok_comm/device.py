"""Device helpers and launch geometry shared by the comm ops (``dispatch``, ``combine``).

Comm kernels deal whole rows to warps: a block is ``COMM_WARPS`` warps, a stand-alone comm
launch ``comm_grid()`` blocks (two per SM keep enough rows in flight to fill NVLink; one row per
warp at a time). Element-wise launches (publish, counting, index) use ``COPY_THREADS`` threads.
"""
from mok_core.cuda_compat import SIM, flat_view, kjit, multiprocessor_count
from mok_core.intrinsics import ld_v4, st_v4

COMM_WARPS = 4 if SIM else 16          # warps per comm block (one row / token each)
COPY_THREADS = 64 if SIM else 256

flat = flat_view


def comm_grid() -> int:
    """Blocks of a stand-alone comm launch: two per SM."""
    return 2 if SIM else 2 * multiprocessor_count()


@kjit(device=True, inline="always")
def copy_row(src, src_off, dst, dst_off, width, lane):
    """One warp copies ``width`` uint16 (a multiple of 8) from src[src_off:] to dst[dst_off:],
    16 bytes per lane per access. Up to eight loads are in flight per lane, unrolled by hand:
    the compiler cannot hoist loads of a peer buffer over stores it cannot prove apart, and one
    load at a time leaves NVLink's round trips exposed."""
    nchunks = width // 8
    j = lane
    while j + 224 < nchunks:
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        b0, b1, b2, b3 = ld_v4(src, src_off + (j + 32) * 8)
        c0, c1, c2, c3 = ld_v4(src, src_off + (j + 64) * 8)
        d0, d1, d2, d3 = ld_v4(src, src_off + (j + 96) * 8)
        e0, e1, e2, e3 = ld_v4(src, src_off + (j + 128) * 8)
        f0, f1, f2, f3 = ld_v4(src, src_off + (j + 160) * 8)
        g0, g1, g2, g3 = ld_v4(src, src_off + (j + 192) * 8)
        h0, h1, h2, h3 = ld_v4(src, src_off + (j + 224) * 8)
        st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
        st_v4(dst, dst_off + (j + 32) * 8, b0, b1, b2, b3)
        st_v4(dst, dst_off + (j + 64) * 8, c0, c1, c2, c3)
        st_v4(dst, dst_off + (j + 96) * 8, d0, d1, d2, d3)
        st_v4(dst, dst_off + (j + 128) * 8, e0, e1, e2, e3)
        st_v4(dst, dst_off + (j + 160) * 8, f0, f1, f2, f3)
        st_v4(dst, dst_off + (j + 192) * 8, g0, g1, g2, g3)
        st_v4(dst, dst_off + (j + 224) * 8, h0, h1, h2, h3)
        j += 256
    while j + 96 < nchunks:
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        b0, b1, b2, b3 = ld_v4(src, src_off + (j + 32) * 8)
        c0, c1, c2, c3 = ld_v4(src, src_off + (j + 64) * 8)
        d0, d1, d2, d3 = ld_v4(src, src_off + (j + 96) * 8)
        st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
        st_v4(dst, dst_off + (j + 32) * 8, b0, b1, b2, b3)
        st_v4(dst, dst_off + (j + 64) * 8, c0, c1, c2, c3)
        st_v4(dst, dst_off + (j + 96) * 8, d0, d1, d2, d3)
        j += 128
    while j < nchunks:
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
        j += 32
