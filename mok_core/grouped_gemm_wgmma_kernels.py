"""Device bodies of the grouped expert GEMMs on Hopper warpgroup MMA (``wgmma``).

Same contract as ``grouped_gemm_kernels`` (read its header: A / a_index / W / off / num_rows /
out, the SWIGLU and plain epilogues, the persistent (expert, column tile, row tile) order);
what differs is how a tile is computed:

    block    = BM / 64 warpgroups (BM = 128: 256 threads; 192: 384; 256: 512, BN <= 128);
               warpgroup g owns rows [64g, 64g + 64) of the tile and all BN columns
               (BN = 64, 128 or 256)
    tiles    = up to BM rows of one expert: experts' rows are padded to multiples of 64 and
               cut into ceil(rows / BM) tiles (a per-expert table in shared memory maps tile
               ids to experts); a warpgroup whose rows lie past the expert stays idle
    K slice  = 64 bf16 = one 128-byte row per tile row: the unit of wgmma's 128-byte swizzle
    ring     = STAGES slices of [A BM x 64 | B BN x 64] in shared memory, 1024-byte aligned,
               16-byte chunk c of row r stored at chunk c ^ (r % 8) (what the descriptors say)
    loads    = all threads, cp.async 16 B (A rows gathered through a_index, padding rows
               zero-filled without a load), PREFETCH = STAGES - 2 slices ahead;
               TMA variant (``tma_b``): B comes as one TMA box per slice (SWIGLU: a gate box
               and an up box) issued by thread 0, landing swizzled and completing on the
               stage's mbarrier full[s]; A stays cp.async (it is gathered)
    MMA      = per slice, per warpgroup: 4 x wgmma m64nBNk16 from two descriptors
               (start address + 32 bytes per k16 step; stride 1024 B between 8-row groups)

Task order of one K step (kt), every thread (a tile's first PREFETCH slices are requested
before the previous tile's direct epilogue, so their latency hides behind its stores):

    1. cp.async.wait  -> my chunks of slice kt landed;  (TMA: wait full[stage of kt])
                         fence.proxy.async (wgmma reads through
                         the async proxy);  __syncthreads -> everyone's chunks landed, and every
                         warpgroup has retired the wgmmas of slice kt-2 (step 4 below)
    2. issue loads of slice kt + PREFETCH into the stage of slice kt - 2 (free, by 1.)
    3. wgmma.fence; 4 wgmmas on slice kt; commit          (tensor cores busy on kt ...)
    4. wgmma.wait(1)  -> slice kt-1's group retired       (... while kt-1 drains)

Async ring (``async_ring``, opt-in: measured within 5 % of the above), slice g counted across
the block's tiles, stage g % STAGES; full[s] waits for one cp.async arrival per thread (+1
with TMA),
empty[s] for one arrival per warp:

    1. wait full[g]; fence.proxy.async
    2. wgmma.fence; 4 wgmmas on slice g; commit; wgmma.wait(1) -> slice g-1 retired
    3. lane 0: arrive empty[g-1]
    4. wait empty[g-1] (every warp done with it); issue slice g + STAGES - 1 into that stage,
       then cp.async.mbarrier.arrive.noinc on its full (thread 0: arm it with TMA bytes)

A warpgroup whose 64 rows are all padding (a_index[first row] < 0, padding sits at the end of
each expert's segment) skips its MMAs and writes zeros. The skip branches on a warp vote
(``warp_all``): under a plain per-thread ``if`` ptxas serialises every wgmma of the kernel
(C7518). FP32 accumulation, K in fixed order, one owner per output tile: deterministic.
"""
from numba import cuda, float32, int32, int64, uint16

from .cuda_compat import kjit
from .grouped_gemm_kernels import swiglu, swiglu_exact
from .intrinsics import (bulk_commit, bulk_load, bulk_load_multicast, bulk_store, bulk_wait,
                         bulk_wait_read, cluster_ctarank, cluster_sync,
                         cp_async_16_at, cp_async_commit, cp_async_mbarrier_arrive,
                         cp_async_wait, f32_zeros, fence_mbarrier_init, fence_proxy_async,
                         mbarrier_arrive, mbarrier_arrive_cluster, mbarrier_arrive_expect_tx,
                         mbarrier_init, mbarrier_test_wait_cluster, mbarrier_try_wait,
                         mbarrier_try_wait_cluster,
                         pack_bf16x2, shared_addr, st_shared_u32, store_f32_tuple, syncwarp,
                         tensormap_acquire, tuple_groups, tuple_pick,
                         tma_load_2d, tma_load_2d_multicast, tma_prefetch_2d, trap,
                         warp_all, wgmma_commit,
                         wgmma_fence, wgmma_m64n64k16_bf16, wgmma_m64n128k16_bf16,
                         wgmma_m64n256k16_bf16, wgmma_wait)

BM = 128                      # tile rows: 2 warpgroups x 64
BK = 64                       # K slice: 64 bf16 = 128 bytes = the swizzle atom's row
THREADS = 256                 # at BM = 128 (2 warpgroups); 384 at BM = 192, 512 at 256
ROW_BYTES = BK * 2
_WGMMA = {64: wgmma_m64n64k16_bf16, 128: wgmma_m64n128k16_bf16, 256: wgmma_m64n256k16_bf16}

# Matrix descriptor bits (PTX ISA, "matrix descriptor"): start address >> 4 in [13:0],
# leading byte offset >> 4 in [29:16] (unused for swizzled K-major; 1 by convention),
# stride byte offset >> 4 in [45:32] (1024 B: next group of 8 rows), swizzle mode in [63:62]
# (1 = 128-byte). Base offset [51:49] stays 0: every tile starts 1024-byte aligned.
_DESC_HIGH = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


@kjit(device=True, inline="always")
def _put_global(out, r, cj, n_out, base, stride, v):
    out[(r * n_out + cj) // 2] = v


@kjit(device=True, inline="always")
def _put_shared(smem, r, cj, n_out, base, stride, v):
    st_shared_u32(smem, base + r * stride + 2 * cj, v)


def _make_pair_epilogue(bn, swiglu_epilogue, put):
    """``pairs(dst, c, acc, r, col, n_out, limit, base, stride)``: this thread's fragment (rows
    r and r + 8, columns col + 8j (+1)) as bf16 pairs, each handed to ``put`` with its row and
    column (SWIGLU: gate columns [0, BN/2) and up columns [BN/2, BN) of the tile pair up into
    BN/2 hidden columns): ``_put_global`` writes ``dst`` = the output (n_out columns),
    ``_put_shared`` stages into shared memory at ``base + row * stride + 2 * column``.
    Through a local array ``c``: the SwiGLU loop stays rolled and the copy lives in local memory
    (a 512-byte stack frame), yet a straight-line epilogue reading the tuple at constant
    indices measured 7-20 % slower on gate/up in the same run (NOTES, session 8)."""
    groups = bn // 8                        # 8-column groups in a thread's fragment
    half = groups // 2                      # SWIGLU: gate groups, then up groups

    @kjit(device=True, inline="always")
    def pairs(dst, c, acc, r, col, n_out, limit, base, stride):
        store_f32_tuple(c, acc)
        if swiglu_epilogue:
            for j in range(half):
                x = 4 * j
                y = 4 * (j + half)
                cj = col + 8 * j
                put(dst, r, cj, n_out, base, stride,
                    pack_bf16x2(swiglu(c[x], c[y], limit), swiglu(c[x + 1], c[y + 1], limit)))
                put(dst, r + 8, cj, n_out, base, stride,
                    pack_bf16x2(swiglu(c[x + 2], c[y + 2], limit),
                                swiglu(c[x + 3], c[y + 3], limit)))
        else:
            for j in range(groups):
                x = 4 * j
                cj = col + 8 * j
                put(dst, r, cj, n_out, base, stride, pack_bf16x2(c[x], c[x + 1]))
                put(dst, r + 8, cj, n_out, base, stride, pack_bf16x2(c[x + 2], c[x + 3]))
    return pairs


def _make_stage_swiglu_group(act):
    def group(j, smem, r, col, limit, base, stride, g0, g1, g2, g3, u0, u1, u2, u3):
        """8-column group j of a SwiGLU fragment: gate and up values of rows r (g0, g1 / u0,
        u1) and r + 8 (g2, g3 / u2, u3) -> bf16 pairs at hidden column col + 8j of the
        staging."""
        at = base + 2 * (col + 8 * j)
        st_shared_u32(smem, at + r * stride, pack_bf16x2(act(g0, u0, limit), act(g1, u1, limit)))
        st_shared_u32(smem, at + (r + 8) * stride,
                      pack_bf16x2(act(g2, u2, limit), act(g3, u3, limit)))
    return group


def _stage_plain_group(j, smem, r, col, limit, base, stride, a0, a1, a2, a3):
    """8-column group j of a plain fragment -> bf16 pairs of rows r and r + 8. (The column
    offset is shared by both rows' addresses: written through ``_put_shared`` instead, ptxas
    keeps more registers and the 192-row kernels spill 192 / 304 bytes, not 64 / 120.)"""
    at = base + 2 * (col + 8 * j)
    st_shared_u32(smem, at + r * stride, pack_bf16x2(a0, a1))
    st_shared_u32(smem, at + (r + 8) * stride, pack_bf16x2(a2, a3))


def _swiglu_layout(count):      # group j: gate elements 4j.., up elements 4(j + half)..
    half = count // 8
    return [[4 * j + i for i in range(4)] + [4 * (j + half) + i for i in range(4)]
            for j in range(half)]


def _plain_layout(count):
    return [[4 * j + i for i in range(4)] for j in range(count // 4)]


def make_stage_tile(bn, swiglu_epilogue, from_regs=True, act=swiglu):
    """``stage_tile(smem, c, acc, r, col, limit, base, stride)``: the fragment's bf16 pairs
    into shared memory -- row r (local to the tile) at ``base + r * stride``, column col
    (local) at byte 2 * col -- for bulk stores to send (``GemmConfig.smem_epilogue``).
    ``from_regs``: read the accumulator tuple at constant indices, group by group
    (``tuple_groups``), so it never goes to local memory; else (probe "stage_local", the
    direct epilogue's way) through the local array ``c``. ``act``: the SwiGLU of the
    register path (probe "exact_act": ``swiglu_exact``; the local-array path has ``swiglu``)."""
    pairs = _make_pair_epilogue(bn, swiglu_epilogue, _put_shared)
    stage_groups = tuple_groups(_make_stage_swiglu_group(act) if swiglu_epilogue
                                else _stage_plain_group,
                                _swiglu_layout if swiglu_epilogue else _plain_layout)

    @kjit(device=True, inline="always")
    def stage_tile(smem, c, acc, r, col, limit, base, stride):
        if from_regs:
            stage_groups(acc, (smem, r, col, limit, base, stride))
        else:
            pairs(smem, c, acc, r, col, 0, limit, base, stride)
    return stage_tile


def make_row_sender(push, send=True):
    """``send_row(out, peers, route_rank, route_token, route_slot, k, n_out, grow, col0, smem,
    src, nbytes)``: one staged output row (``nbytes`` at the shared byte address ``src``) by a
    bulk store to row ``grow`` of ``out`` (uint32 view, n_out bf16 columns), from column
    ``col0`` on -- or, with ``push``, to its source rank's combine row (``make_tile_ops``;
    padding rows, rank < 0, are not sent). ``send=False`` (probe "stage_only"): nothing."""
    @kjit(device=True, inline="always")
    def send_row(out, peers, route_rank, route_token, route_slot, k, n_out, grow, col0, smem,
                 src, nbytes):
        if send:
            if push:
                rank = route_rank[grow]
                if rank >= 0:
                    bulk_store(tuple_pick(peers, rank),
                               ((route_token[grow] * k + route_slot[grow]) * n_out + col0) // 2,
                               smem, src, nbytes)
            else:
                bulk_store(out, (grow * n_out + col0) // 2, smem, src, nbytes)
    return send_row


def make_tile_ops(bn, swiglu_epilogue, push=False):
    """The two per-warpgroup steps both wgmma kernels share (compile-time BN and epilogue):

    ``mma_slice(acc, smem, desc_a, desc_b) -> acc``: one 64-wide K slice = wgmma.fence, 4 x
    wgmma m64nBNk16 (the k16 steps are 32 bytes apart: +2 in the descriptor's address field),
    commit; the caller decides how long to let it run (``wgmma_wait``).
    ``store_tile(out, c, acc, r, col, n_out, limit, route_rank, route_token, route_slot, peers,
    k)``: waits nothing; the fragment of this thread (rows r and r + 8, columns col + 8j (+1))
    -> bf16 pairs in ``out`` (SWIGLU: gate columns [0, BN/2) and up columns [BN/2, BN) of the
    tile pair up into BN/2 hidden columns); ``c`` is a float32 local array of BN/2 to loop over.
    ``push`` (the down GEMM fused with the combine): row r's pairs go instead straight into its
    source rank's combine buffer ``peers[route_rank[r]]`` (uint32 view of [T*k, H] bf16) at row
    ``route_token[r] * k + route_slot[r]`` -- over NVLink for a peer; padding rows (rank < 0)
    are dropped. Same bits as writing y and pushing its rows afterwards.
    """
    mma = _WGMMA[bn]
    groups = bn // 8                        # 8-column groups in a thread's fragment

    @kjit(device=True, inline="always")
    def mma_slice(acc, smem, da, db):
        acc = wgmma_fence(acc)
        acc = mma(acc, smem, da, db)
        acc = mma(acc, smem, da + 2, db + 2)
        acc = mma(acc, smem, da + 4, db + 4)
        acc = mma(acc, smem, da + 6, db + 6)
        wgmma_commit()
        return acc

    pairs = _make_pair_epilogue(bn, swiglu_epilogue, _put_global)

    @kjit(device=True, inline="always")
    def store_tile(out, c, acc, r, col, n_out, limit, route_rank, route_token, route_slot, peers,
                   k):
        if push:
            store_f32_tuple(c, acc)
            for h in range(2):                  # rows r, r + 8: pairs 2h, 2h + 1 of a group
                row = r + 8 * h
                src = route_rank[row]
                if src >= 0:
                    dst = tuple_pick(peers, src)     # (peers[src]: a switch -> C7518)
                    base = ((route_token[row] * k + route_slot[row]) * n_out + col) // 2
                    for j in range(groups):
                        x = 4 * j + 2 * h
                        dst[base + 4 * j] = pack_bf16x2(c[x], c[x + 1])
        else:
            pairs(out, c, acc, r, col, n_out, limit, 0, 0)

    return mma_slice, store_tile


def make_slice_loader(swiglu_epilogue, gather, a_rows, b_rows, read_a=True):
    """The cp.async side both wgmma kernels share. A loading thread owns one 16-byte chunk
    column of ``a_rows`` A rows and ``b_rows`` B rows of every K slice, its rows a fixed step
    apart (so they share one swizzle):

    ``a_sources(a_index, first_row, row_step, row_end, K, chunk, a_src, a_nb)``: per tile, the
    element offset of each of its A chunks (row through ``a_index`` when gathering) and the
    bytes to read (16; 0 for a padding row or a row at/after ``row_end`` -- the next expert's --,
    which cp.async zero-fills -- kept apart from the offset so the K loop does no per-chunk
    selects). ``read_a=False`` (a measurement build) zero-fills every A chunk: no A traffic.
    ``load_slice(smem, dst, dst_step, a_stage, a, w0, w1, a_src, a_nb, b_src, b_step, k0)``: one
    slice's A chunks (padding rows zero-filled, no global read), then its B chunks at
    ``dst + a_stage`` (SWIGLU: the first half of B's rows from w0 = gate, the rest from w1).
    """
    b_first = b_rows // 2 if swiglu_epilogue else b_rows

    @kjit(device=True, inline="always")
    def a_sources(a_index, first_row, row_step, row_end, K, chunk, a_src, a_nb):
        for j in range(a_rows):
            r = first_row + row_step * j
            src = -1
            if r < row_end:
                src = a_index[r] if gather else r
            a_nb[j] = 16 if src >= 0 and read_a else 0
            a_src[j] = max(src, 0) * K + chunk * 8

    @kjit(device=True, inline="always")
    def load_slice(smem, dst, dst_step, a_stage, a, w0, w1, a_src, a_nb, b_src, b_step, k0):
        for j in range(a_rows):
            cp_async_16_at(smem, dst + j * dst_step, a, a_src[j] + k0, a_nb[j])
        dst += a_stage
        src = b_src + k0
        for j in range(b_first):
            cp_async_16_at(smem, dst + j * dst_step, w0, src + j * b_step, 16)
        for j in range(b_rows - b_first):
            cp_async_16_at(smem, dst + (b_first + j) * dst_step, w1, src + j * b_step, 16)

    return a_sources, load_slice


_SPIN_LIMIT = 1 << 22         # try_wait rounds before a wait is declared hung (~seconds)


def _bounded_wait(try_wait):
    @kjit(device=True, inline="always")
    def wait(smem, bar, parity):
        n = 0
        while try_wait(smem, bar, parity) == 0:
            n += 1
            if n == _SPIN_LIMIT:
                trap()
    return wait


# Until the mbarrier at ``bar`` completed the phase of ``parity``. Bounded: only a bug in the
# kernel itself can make it time out, and then it traps (a launch failure, not a hang).
wait_phase = _bounded_wait(mbarrier_try_wait)
# The same acquiring at cluster scope (arrivals from other blocks of the cluster).
wait_phase_cluster = _bounded_wait(mbarrier_try_wait_cluster)


def make_tma_b_loader(bn, swiglu_epilogue, read_b=True, packed=False):
    """``tma_b(smem, dst, tmaps, bar, row, k0, w0, w1, K)``: one thread's TMA of a slice's B
    operand (BN weight rows x 64 K values) to the shared byte address ``dst``, completing on
    the mbarrier ``bar`` (armed here with the slice's bytes). SWIGLU: BN/2 gate rows from map 0
    and BN/2 up rows from map 1, both starting at weight row ``row``; else BN rows of map 0.
    The maps carry the 128-byte swizzle, so the box lands in the layout the B descriptor reads.
    ``packed`` (``mok_core.weight_pack``): the weights ``w0`` / ``w1`` (flat, K per row) are
    stored box by box, pre-swizzled, so each box is one contiguous 1-D bulk copy from element
    ``row * K + k0 * box_rows`` -- no tensor map, whole DRAM pages per box.
    ``prefetch_b(tmaps, row, k0)``: the same boxes into L2 only (no barrier, nothing to wait
    for), issued some slices ahead so the load itself finds its weights in L2, not HBM.
    ``read_b=False`` (a measurement build): the barrier completes with no bytes, no B traffic."""
    half_bytes = (bn // 2) * ROW_BYTES
    box = bn // 2 if swiglu_epilogue else bn

    @kjit(device=True, inline="always")
    def tma_b(smem, dst, tmaps, bar, row, k0, w0, w1, K):
        if not read_b:
            mbarrier_arrive_expect_tx(smem, bar, 0)
            return
        mbarrier_arrive_expect_tx(smem, bar, bn * ROW_BYTES)
        if packed:
            src = int64(row) * K + int64(k0) * box
            bulk_load(smem, dst, w0, src, box * ROW_BYTES, bar)
            if swiglu_epilogue:
                bulk_load(smem, dst + half_bytes, w1, src, half_bytes, bar)
            return
        tma_load_2d(smem, dst, tmaps, 0, k0, row, bar)
        if swiglu_epilogue:
            tma_load_2d(smem, dst + half_bytes, tmaps, 16, k0, row, bar)

    @kjit(device=True, inline="always")
    def prefetch_b(tmaps, row, k0):
        if not read_b:
            return
        tma_prefetch_2d(tmaps, 0, k0, row)
        if swiglu_epilogue:
            tma_prefetch_2d(tmaps, 16, k0, row)

    return tma_b, prefetch_b


def make_tma_b_share(bn, swiglu_epilogue, packed, cluster):
    """``tma_b_share(smem, dst, tmaps, bar, row, k0, w0, w1, K, rank)``: the weight slice of a
    cluster of ``cluster`` blocks (1 or 2) that compute row tiles of one expert against the
    same BN weight rows. Every block arms its own ``bar`` with the whole slice's bytes, then
    fetches its share, multicast into every block of the cluster at the same ``dst``:
    cluster 2 -- rank 0 the first BN/2 rows (SWIGLU: the gate box), rank 1 the rest (the up
    box); cluster 1 -- both halves, plain loads (what the simulator runs). Tensor maps: boxes
    of BN/2 rows (gate/up, and down whenever ``multicast`` >= 1); ``packed``: a box's rows are
    contiguous, so half a box is one bulk copy."""
    assert cluster in (1, 2)
    half_rows = bn // 2
    half_bytes = half_rows * ROW_BYTES
    box = half_rows if swiglu_epilogue else bn          # rows of a packed box
    mask = (1 << cluster) - 1

    @kjit(device=True, inline="always")
    def share(smem, dst, tmaps, bar, row, k0, w0, w1, K, part):
        """Half ``part`` (0: rows [0, BN/2), 1: [BN/2, BN)) of the slice, to every block."""
        d = dst + part * half_bytes
        if packed:
            src = int64(row) * K + int64(k0) * box
            if swiglu_epilogue:
                if part == 0:
                    w = w0
                else:
                    w = w1
            else:
                w = w0
                src += part * half_rows * BK
            if cluster == 1:
                bulk_load(smem, d, w, src, half_bytes, bar)
            else:
                bulk_load_multicast(smem, d, w, src, half_bytes, bar, mask)
            return
        if swiglu_epilogue:                              # gate map at element 0, up at 16
            elem = 16 * part
            y = row
        else:
            elem = 0
            y = row + part * half_rows
        if cluster == 1:
            tma_load_2d(smem, d, tmaps, elem, k0, y, bar)
        else:
            tma_load_2d_multicast(smem, d, tmaps, elem, k0, y, bar, mask)

    @kjit(device=True, inline="always")
    def tma_b_share(smem, dst, tmaps, bar, row, k0, w0, w1, K, rank):
        mbarrier_arrive_expect_tx(smem, bar, bn * ROW_BYTES)
        if cluster == 1:
            share(smem, dst, tmaps, bar, row, k0, w0, w1, K, 0)
            share(smem, dst, tmaps, bar, row, k0, w0, w1, K, 1)
        else:
            share(smem, dst, tmaps, bar, row, k0, w0, w1, K, rank)

    return tma_b_share


MAX_EXPERTS = 512             # per launch: the tile table in shared memory is sized for it
_TABLE_BYTES = -(-2 * (MAX_EXPERTS + 1) // 8) * 8     # uint16 [E + 1], mbarriers 8-aligned after


def smem_bytes(bn, stages, bm=BM):
    """Dynamic shared memory of one block: the per-expert tile table (uint16 [E + 1]), 2 x
    STAGES mbarriers (full: TMA / async ring; empty: async / cluster ring), slack to align the
    ring to 1024 bytes, the ring."""
    return _TABLE_BYTES + 16 * stages + 1024 + stages * (bm + bn) * ROW_BYTES


@kjit(device=True, inline="always")
def tile_table(smem, offsets, num_experts, bm, rows_cap):
    """Thread 0 writes first[e] = row tiles of experts < e (uint16 smem[0 .. E]): an expert's
    rows (padded to a multiple of 64) are cut into ceil(rows / bm) tiles that never cross into
    the next expert, so bm need not divide the padding. Offsets are clamped to ``rows_cap``
    (the rows the buffers hold): after a capacity overflow -- flagged by the schedule -- the
    GEMM stays inside its arrays (and its pushes inside real rows). The caller syncs."""
    if cuda.threadIdx.x == 0:
        acc = 0
        for e in range(num_experts):
            smem[e] = acc
            lo = min(offsets[e], rows_cap)
            acc += (min(offsets[e + 1], rows_cap) - lo + bm - 1) // bm
        smem[num_experts] = acc


@kjit(device=True, inline="always")
def find_tile_in_table(smem, offsets, num_experts, t, n_tiles, bm, rows_cap):
    """Tile id -> (expert, first row, column tile, end of the expert's rows, clamped to
    ``rows_cap``); order (expert, column tile, row tile), the expert's first tile id =
    first[e] * n_tiles."""
    lo = 0
    hi = num_experts - 1
    while lo < hi:                         # last expert whose first tile id <= t
        mid = (lo + hi + 1) // 2
        if int64(smem[mid]) * n_tiles <= t:
            lo = mid
        else:
            hi = mid - 1
    first = int64(smem[lo])
    m_tiles = int64(smem[lo + 1]) - first
    local = t - first * n_tiles
    return (lo, min(offsets[lo], rows_cap) + (local % m_tiles) * bm, local // m_tiles,
            min(offsets[lo + 1], rows_cap))


PROBES = ("", "no_a", "no_b", "no_mma", "no_store", "mma_first", "mc_local", "mc_unicast",
          "mc_b_first", "mc_no_poll", "rows16", "stage_only", "stage_local", "loads_first",
          "exact_act")
STAGED_PROBES = {"rows16", "stage_only", "stage_local", "loads_first", "exact_act"}
MC_PROBES = {"mma_first", "mc_local", "mc_unicast", "mc_b_first", "mc_no_poll"}


def probe_parts(probe):
    """The set of probe names in ``probe`` (several join with "+": "no_a+no_b")."""
    return set(probe.split("+")) - {""}


def make_wgmma_grouped_gemm(bn, stages, swiglu_epilogue, gather, padding_index,
                            max_registers=0, tma_b=False, push=False, bm=BM, l2_prefetch=0,
                            probe="", async_ring=False, packed_b=False, blocks_per_sm=1,
                            multicast=0, smem_epilogue=False):
    """Build one wgmma grouped-GEMM specialisation (BN, STAGES, epilogue compile-time).

    ``gather``: A rows come through ``a_index``; ``padding_index``: ``a_index`` marks padding
    rows (< 0) even when A is not gathered, so all-padding warpgroups skip their MMAs.
    ``tma_b``: thread 0 loads each slice's B (weights) with TMA boxes from the tensor maps in
    ``tmaps`` (completing on the stage's mbarrier ``full[s]``) instead of every thread issuing
    cp.async chunks for it; A stays cp.async (it may be gathered). Step 1 then also waits
    ``full[s]`` (phase bit per stage, flipped at each wait).
    ``push``: the epilogue sends rows home (``make_tile_ops``); else the route arguments are
    unused placeholders.
    ``bm``: 128 (2 warpgroups), 192 (3 warpgroups, 384 threads, B by TMA) or 256 (4
    warpgroups, 512 threads, B by TMA, BN <= 128: an expert of 193..256 rows -- glm at 4096
    tokens, deepseek-v4-pro at 8192 -- reads its weights once, no warpgroup idle). Experts' rows are
    padded to multiples of 64; a tile is up to bm rows of one expert (``tile_table``): with
    192, an expert of <= 192 rows loads each weight slice once instead of twice -- the B
    traffic from L2, which bounds these GEMMs, falls by up to a third.
    ``l2_prefetch`` (TMA only): thread 0 also asks for the weight boxes of the slice that many
    slices past the newest load to be brought into L2 (``cp.async.bulk.prefetch``), so a
    slice's TMA load waits on L2, not HBM, while the ring itself stays STAGES deep.
    ``async_ring``: stages change hands through mbarriers instead of a block barrier per
    slice -- full[s] completes when every thread's cp.async chunks of the slice landed
    (``cp.async.mbarrier.arrive.noinc``) and, with TMA, its B bytes; empty[s] when every warp
    retired its wgmmas on the slice. Loads then run STAGES - 1 slices ahead (not STAGES - 2)
    and no warp waits for another before issuing its MMAs (see the K loop below). The stage
    counter runs on across tiles, but the next tile's first slices are requested only once
    the current tile's MMAs all retired (before its epilogue), as in the block-barrier ring:
    the ring drains once per tile. (``mma_first`` is the async ring's order anyway.)
    ``blocks_per_sm``: blocks meant to be resident per SM (launch bounds: ptxas caps the
    registers so that many fit -- without it the down kernel at 128 x 128 takes 140 registers
    and a second block never fits).
    ``packed_b`` (with ``tma_b``): the weights are in the packed layout
    (``mok_core.weight_pack``, boxes of BN/2 rows for gate/up, BN for down) and each box comes
    by one contiguous bulk copy instead of a TMA box.
    ``probe`` (measurement builds: ``benchmarks/probe_gemm.py``; several join with "+"; the
    "no_*" ones give wrong results): "no_a" / "no_b" drop the A / B traffic (zero-filled /
    barrier completed empty), "no_mma" skips the MMAs, "no_store" the epilogue's stores (still
    compiled, behind a test that is false at run time, so the MMAs feed something),
    "mma_first" issues a slice's wgmmas before the loads of slice kt + PREFETCH (legal: those
    go to the stage of kt - 2); with ``multicast``: "mc_unicast", "mc_local",
    "mc_b_first", "mc_no_poll" (below); with ``smem_epilogue``: "rows16" (lanes 0..15 send a
    row each, as with ``push``, instead of lane 0 all 16; same results), "stage_only" (the
    tile is staged, no bulk store sent: what the staging alone costs; wrong results),
    "stage_local" (the tile staged through the local-array copy of the accumulator, as
    before session 10, with today's SwiGLU; same results), "exact_act" (the staged SwiGLU
    through ``math.exp`` and an IEEE division, as before session 10; results within float32
    rounding; not with "stage_local").
    ``multicast`` (with ``tma_b``; 0 = off): a cluster of that many blocks (1 or 2; launch with
    ``cuda_compat.launch_cluster``) takes the row tiles of one expert that meet the same
    weight columns -- a work tile is ``multicast * bm`` rows, block rank r computes rows
    [r bm, (r + 1) bm) of it -- and each weight slice is read from L2 once for all of them:
    every block fetches a share and multicasts it into every block's ring
    (``make_tma_b_share``). The cluster ring (K loop below) then needs to know that a stage is
    free in *every* block before anyone's share lands in it: empty[s] takes one arrival per
    warp of every block of the cluster (as soon as that warp's wgmmas retired the slice), and
    a block's thread 0 waits on (or polls) its own empty[s] before issuing its share
    (``issue_b_shares``). Stage of slice g = g % STAGES, g counted across the block's tiles
    (both blocks of a cluster walk the same tiles). A block whose rows lie past the expert
    still loads its share (its MMAs idle). Cluster 1 is the same protocol with plain loads and
    local arrivals: what the simulator runs. Measured 1.3-2.2x slower than the plain kernel
    on H200 (NOTES.md, session 7): an opt-in.
    ``smem_epilogue`` (block ring): the epilogue stages the tile's bf16 pairs in the two ring
    stages the next tile's prologue leaves free and each warp's lane 0 sends its 16 rows with
    bulk stores (one per row; the copy engine of the SM moves them while the next tile's MMAs
    run) instead of every thread storing 4-byte pairs to global memory while the block's MMAs
    stand still -- the down GEMM spends 9-19 % there (NOTES, session 8). With ``push`` lanes
    0..15 send one row each, to its source rank's combine row (peer memory over NVLink; padding
    rows are not sent). Rows are staged ``row bytes + 16`` apart, so the 8 rows of a warp's
    store hit different banks. The staging stages are reloaded by the next tile's first K
    step: the sending lanes wait until their bulk stores have *read* them
    (``bulk_wait_read``) before that step's block barrier. The staging runs before the next
    tile's prologue loads are issued (probe "loads_first": after them, as the direct stores
    do -- measured no faster at 128 rows, up to 28 % slower on qwen's gate/up, and it spills
    more at 192: NOTES, session 10) and reads the accumulator tuple at constant indices
    (``tuple_groups``: at 192 rows the local-array copy spilled 176-304 bytes, this 64-120;
    probe "stage_local": that copy).
    """
    parts = probe_parts(probe)
    assert multicast in (0, 1, 2)
    assert not multicast or (tma_b and not async_ring and not l2_prefetch
                             and parts <= MC_PROBES)
    cl = max(multicast, 1)                  # blocks per cluster (1: no cluster)
    tile_rows = cl * bm                     # rows of one work tile (the cluster's)
    assert bn in _WGMMA and stages >= 3 and bm in (128, 192, 256) and parts <= set(PROBES)
    assert bm < 256 or bn <= 128, "4 warpgroups hold at most 64 accumulators per thread"
    assert tma_b or (l2_prefetch == 0 and "no_b" not in parts and not packed_b)
    assert not (packed_b and l2_prefetch)
    n_wg = bm // 64
    threads = 128 * n_wg
    pass_rows = threads // 8                # rows covered when every thread copies one chunk
    pass_bytes = pass_rows * ROW_BYTES
    assert tma_b or bn % pass_rows == 0, "B by cp.async needs BN rows to split evenly"
    mma_slice, store_tile = make_tile_ops(bn, swiglu_epilogue, push)
    nacc = bn // 2                          # fp32 accumulators per thread
    a_stage = bm * ROW_BYTES
    stage_bytes = (bm + bn) * ROW_BYTES
    staged = smem_epilogue
    assert not staged or not (async_ring or multicast), "smem_epilogue: block ring only"
    out_row_bytes = (bn // 2 if swiglu_epilogue else bn) * 2     # bf16 of one output row
    epi_stride = out_row_bytes + 16         # +16: a warp's 8 rows land in 8 bank groups
    assert not staged or bm * epi_stride <= 2 * stage_bytes
    stage_tile = make_stage_tile(bn, swiglu_epilogue, from_regs="stage_local" not in parts,
                                 act=swiglu_exact if "exact_act" in parts else swiglu)
    prefetch = stages - 2
    in_flight = prefetch - 1                # cp.async groups allowed pending at step 1
    a_passes = bm // pass_rows              # A rows per loading thread (a compile-time size)
    a_sources, load_slice = make_slice_loader(swiglu_epilogue, gather, a_passes,
                                              0 if tma_b else bn // pass_rows,
                                              read_a="no_a" not in parts)
    tma_b_load, prefetch_b = make_tma_b_loader(bn, swiglu_epilogue, read_b="no_b" not in parts,
                                               packed=packed_b)
    # measurement builds of the cluster ring: "mc_unicast" -- every block loads the whole
    # slice itself (no multicast), releases still go to every block; "mc_local" -- no traffic
    # between the blocks at all (what is left: the cluster launch and the ring's structure)
    # "mc_b_first": thread 0 also issues the shares it can right after the block barrier,
    # before the A loads and MMAs (the block ring's B timing); "mc_no_poll": no shares ahead
    # of the one needed next (what the poll buys)
    share_blocks = 1 if parts & {"mc_local", "mc_unicast"} else cl
    b_first = "mc_b_first" in parts
    poll_ahead = stages - 1 if "mc_no_poll" not in parts else 1
    release_blocks = 1 if "mc_local" in parts else cl
    tma_b_share = make_tma_b_share(bn, swiglu_epilogue, packed_b, share_blocks)
    mma_first = "mma_first" in parts
    skip_mma = "no_mma" in parts
    no_store = "no_store" in parts
    assert staged or not parts & STAGED_PROBES
    assert not {"stage_local", "exact_act"} <= parts, "exact_act: the register path only"
    per_lane = push or "rows16" in parts    # lanes 0..15 send one row each (else lane 0 all)
    stage_first = "loads_first" not in parts    # stage, then the next tile's prologue loads
    send_row = make_row_sender(push, send="stage_only" not in parts)
    ahead = stages - 1 if async_ring else prefetch     # slices requested before the first MMA
    full_count = (threads if async_ring else 0) + (1 if tma_b else 0)
    warps = threads // 32
    uses_index = gather or padding_index
    opts = {"max_registers": max_registers} if max_registers else {}
    if n_wg >= 3 or blocks_per_sm > 1:  # ptxas: fit 384 threads (<= 168 registers), 512
        opts["launch_bounds"] = (threads, blocks_per_sm)    # (<= 128), or several blocks

    @kjit(device=True, inline="always")
    def load_stage(smem, st, k0, ring, full0, tmaps, dst0, a, w0, w1, a_src, a_nb, b_src,
                   b_pass_elems, b_row, tid, ktiles):
        """Slice at K offset k0 into ring stage st: A (and B unless TMA) by every thread's
        cp.async; with TMA, thread 0 arms full[st] and issues B's box(es) (and the L2 prefetch of
        the slice ``l2_prefetch`` further). ``multicast``: A only (B: ``issue_b_shares``)."""
        load_slice(smem, dst0 + st * stage_bytes, pass_bytes, a_stage, a, w0, w1, a_src, a_nb,
                   b_src, b_pass_elems, k0)
        if async_ring:                         # full[st] counts this thread once its chunks land
            cp_async_mbarrier_arrive(smem, full0 + 8 * st)
        if tma_b and tid == 0 and not multicast:
            tma_b_load(smem, ring + st * stage_bytes + a_stage, tmaps, full0 + 8 * st, b_row, k0,
                       w0, w1, ktiles * BK)
            if l2_prefetch and k0 + l2_prefetch * BK < ktiles * BK:
                prefetch_b(tmaps, b_row, k0 + l2_prefetch * BK)

    @kjit(device=True, inline="always")
    def issue_slice(smem, gl, kidx, ring, full0, tmaps, dst0, a, w0, w1, a_src, a_nb, b_src,
                    b_pass_elems, b_row, tid, ktiles):
        """Async ring: the block's global slice ``gl`` (slice ``kidx`` of its tile) into stage
        gl % STAGES, once every warp released that stage's previous slice (gl - STAGES)."""
        st = gl % stages
        if gl >= stages:
            wait_phase(smem, full0 + 8 * stages + 8 * st,     # empty[st]: after the fulls
                       ((gl // stages) - 1) & 1)
        load_stage(smem, st, kidx * BK, ring, full0, tmaps, dst0, a, w0, w1, a_src, a_nb,
                   b_src, b_pass_elems, b_row, tid, ktiles)

    @kjit(device=True, inline="always")
    def release(smem, empty0, g, rank):
        """Cluster ring, lane 0 of a warp: this warp is done with slice ``g`` -- one arrival on
        its stage's empty barrier in every block of the cluster (own block only: "mc_local")."""
        for blk in range(release_blocks):
            mbarrier_arrive_cluster(smem, empty0 + 8 * (g % stages),
                                    blk if release_blocks > 1 else rank)

    @kjit(device=True, inline="always")
    def issue_b_shares(smem, b_next, need, last, ring, full0, tmaps, b_row, g0, w0, w1, K, rank):
        """Cluster ring, thread 0: this block's shares of B for slices ``b_next``, ... (block-
        global; ``g0`` = the tile's first): every slice up to ``need`` -- waiting until its
        stage is free in every block of the cluster --, then slices up to ``last`` as long
        as their stage already is (a poll, no wait). Returns the next slice to issue. Polling
        ahead lets the peers' releases arrive while MMAs run, instead of a cross-SM round trip
        per slice on the critical path."""
        empty0 = full0 + 8 * stages
        while b_next <= last:
            st = b_next % stages
            parity = ((b_next // stages) & 1) ^ 1     # the release of slice b_next - STAGES
            if b_next > need:
                if mbarrier_test_wait_cluster(smem, empty0 + 8 * st, parity) == 0:
                    break
            else:
                wait_phase_cluster(smem, empty0 + 8 * st, parity)
            tma_b_share(smem, ring + st * stage_bytes + a_stage, tmaps, full0 + 8 * st, b_row,
                        (b_next - g0) * BK, w0, w1, K, rank)
            b_next += 1
        return b_next

    @kjit(device=True, inline="always")
    def tile_start(smem, a, a_index, w0, w1, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring,
                   full0, dst0, a_src, a_nb, b_pass_elems, ld_row, ld_chunk, wg, tid, rows_cap,
                   g0, rank, b_next):
        """Tile t (block ``rank`` of the cluster: its ``bm`` rows of the tile): where this
        thread's chunks come from (A rows gathered; padding rows and rows past the expert
        zero-filled, no read), whether its warpgroup's 64 rows are the expert's (``owned``)
        and hold real rows (``active``), and its first PREFETCH slices requested (cluster
        ring: B's from ``b_next`` on). Returns (first row, first output
        column, B source, B's first weight row, active, owned, next B share to issue)."""
        e, row0, nt, row_end = find_tile_in_table(smem, offsets, offsets.shape[0] - 1, t,
                                                  n_tiles, tile_rows, rows_cap)
        row0 += rank * bm
        col0 = nt * (bn // 2 if swiglu_epilogue else bn)
        a_sources(a_index, row0 + ld_row, pass_rows, row_end, K, ld_chunk, a_src, a_nb)
        b_row = e * n_w + col0
        b_src = (b_row + ld_row) * K + ld_chunk * 8
        first = row0 + wg * 64
        owned = first < row_end
        active = owned
        if uses_index and owned:
            active = a_index[first] >= 0
        if skip_mma:
            active = False
        for s in range(ahead):
            if async_ring:                     # global slice g0 + s (``g0``: the tile's first)
                if s < ktiles:
                    issue_slice(smem, g0 + s, s, ring, full0, tmaps, dst0, a, w0, w1, a_src,
                                a_nb, b_src, b_pass_elems, b_row, tid, ktiles)
            else:                              # block ring (cluster ring: stage of g0 + s)
                if s < ktiles:
                    st = (g0 + s) % stages if multicast else s
                    load_stage(smem, st, s * BK, ring, full0, tmaps, dst0, a, w0, w1, a_src,
                               a_nb, b_src, b_pass_elems, b_row, tid, ktiles)
                cp_async_commit()
        if multicast and tid == 0:
            # Every prologue share, waiting where a peer's release is late: a poll would leave
            # slice g0 + 1 to the K loop's first step, behind the peer's epilogue.
            last = g0 + min(stages - 1, ktiles) - 1
            b_next = issue_b_shares(smem, b_next, last, last, ring, full0, tmaps, b_row, g0,
                                    w0, w1, ktiles * BK, rank)
        if l2_prefetch and tid == 0:           # the slices the K loop's prefetches skip
            for s in range(ahead, l2_prefetch):     # (the prologue's loads cover the rest)
                if s < ktiles:
                    prefetch_b(tmaps, b_row, s * BK)
        return row0, col0, b_src, b_row, active, owned, b_next

    @kjit(device=True, inline="always")
    def stage_and_send(smem, c, acc, out, peers, route_rank, route_token, route_slot, k, n_out,
                       limit, ring, lane, frag_row, frag_col, row0, col0, stores):
        """Staged epilogue of the tile at (row0, col0): bf16 pairs -> the ring stages the next
        tile's prologue leaves free (PREFETCH..); this warp's 16 rows -> out by bulk stores,
        lane 0's (push / "rows16": lane i's, row i) -- the warp staged exactly those rows: a
        warp barrier suffices. The bulk copies run on behind the next tile's MMAs. The vote
        makes the branch warp-uniform to ptxas: a warp barrier on a path it thinks divergent
        serialises every wgmma of the kernel (C7518)."""
        if warp_all(stores) != 0:
            epi0 = ring + prefetch * stage_bytes    # the stages free at epilogue time
            stage_tile(smem, c, acc, frag_row, frag_col, limit, epi0, epi_stride)
            fence_proxy_async()            # generic-proxy writes -> bulk reads
            syncwarp()
            if per_lane:
                # Lane i < 16 sends row i of the warp's 16 (push: home -- its route
                # lookups run in parallel, not one after another in lane 0).
                if lane < 16:
                    srow = frag_row - lane // 4 + lane    # the warp's first row + i
                    send_row(out, peers, route_rank, route_token, route_slot, k, n_out,
                             row0 + srow, col0, smem, epi0 + srow * epi_stride, out_row_bytes)
                    bulk_commit()
            elif lane == 0:
                for i in range(16):            # lane 0's row is the warp's first
                    send_row(out, peers, route_rank, route_token, route_slot, k, n_out,
                             row0 + frag_row + i, col0, smem,
                             epi0 + (frag_row + i) * epi_stride, out_row_bytes)
                bulk_commit()

    @kjit(**opts)
    def kernel(a, a_index, w0, w1, tmaps, offsets, num_rows, out, K, n_w, n_out, limit,
               route_rank, route_token, route_slot, peers, k):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg = tid // 128
        lane = tid % 32
        frag_row = wg * 64 + ((tid % 128) // 32) * 16 + lane // 4   # (+8): this thread's rows
        frag_col = 2 * (lane % 4)
        num_experts = offsets.shape[0] - 1
        n_tiles = n_out // (bn // 2 if swiglu_epilogue else bn)
        ktiles = K // BK

        # Shared memory: the tile table, the TMA barriers, then the ring aligned to the
        # swizzle atom; where this thread's 16-byte chunks land in pass 0 (pass i adds
        # i * pass_bytes: pass_rows rows on, same row % 8, same swizzle).
        sbase = shared_addr(smem)
        full0 = sbase + _TABLE_BYTES            # full[s] at full0 + 8 s, empty[s] 8 STAGES on
        empty0 = full0 + 8 * stages
        ring0 = empty0 + 8 * stages
        ring = ring0 + (1024 - ring0 % 1024) % 1024
        ld_row = tid // 8
        ld_chunk = tid % 8
        dst0 = ring + ld_row * ROW_BYTES + ((ld_chunk ^ (ld_row % 8)) * 16)
        desc_a0 = int64(_DESC_HIGH) + int64((ring + wg * 64 * ROW_BYTES) >> 4)
        desc_b0 = int64(_DESC_HIGH) + int64((ring + a_stage) >> 4)
        b_pass_elems = int64(pass_rows) * K
        # Rows the buffers hold: the output's (gate/up: hidden [C, n_out] as bf16 pairs) or
        # A's (down: hidden [C, K]; its output may be a placeholder when pushing).
        rows_cap = out.shape[0] * 2 // n_out if swiglu_epilogue else a.shape[0] // K
        tile_table(smem, offsets, num_experts, tile_rows, rows_cap)
        if full_count and tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, full_count)
                if async_ring:
                    mbarrier_init(smem, empty0 + 8 * s, warps)
                if multicast:                  # one release per warp of every block
                    mbarrier_init(smem, empty0 + 8 * s, release_blocks * warps)
            if tma_b and not packed_b:         # packed weights: no maps (a placeholder)
                tensormap_acquire(tmaps, 0)
                if swiglu_epilogue:
                    tensormap_acquire(tmaps, 16)
            fence_mbarrier_init()
        if multicast:                          # peers arrive on / multicast into our barriers
            cluster_sync()
        else:
            cuda.syncthreads()
        total = int64(smem[num_experts]) * n_tiles
        rank = cluster_ctarank() if multicast > 1 else 0
        phases = 0                              # TMA: bit s = parity of full[s]'s next phase

        a_src = cuda.local.array(a_passes, int64)
        a_nb = cuda.local.array(a_passes, int32)
        c = cuda.local.array(nacc, float32)    # the accumulator, for the epilogue's loop

        # Tile loop. A tile's first PREFETCH slices are requested before the previous tile's
        # direct epilogue runs (the ring is free by then), so their latency hides behind its
        # stores; the staged epilogue runs before them (probe "loads_first": after).
        t = cuda.blockIdx.x // cl              # the cluster's index (the block's without one)
        g0 = int64(0)                          # async / cluster ring: block-global slice index
        row0 = 0
        col0 = 0
        b_src = 0
        b_row = 0
        active = True
        owned = True
        b_next = int64(0)                      # cluster ring, thread 0: next B share to issue
        if t < total:
            row0, col0, b_src, b_row, active, owned, b_next = tile_start(
                smem, a, a_index, w0, w1, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring,
                full0, dst0, a_src, a_nb, b_pass_elems, ld_row, ld_chunk, wg, tid, rows_cap,
                g0, rank, b_next)
        while t < total:
            acc = f32_zeros(nacc)
            if async_ring:
                # Per slice g (block-global): wait full[g] -> MMAs on g, commit -> wgmma.wait(1):
                # g - 1 retired -> release it (empty, one arrival per warp) -> request slice
                # g + STAGES - 1 into g - 1's stage once every warp released it. The MMAs of g
                # are queued before this warp waits on anyone, and loads stay STAGES - 1 ahead.
                for kt in range(ktiles):
                    g = g0 + kt
                    st = g % stages
                    wait_phase(smem, full0 + 8 * st, (g // stages) & 1)
                    fence_proxy_async()            # cp.async (generic proxy) -> wgmma reads
                    run_mma = warp_all(active) != 0
                    if run_mma:
                        soff = (st * stage_bytes) >> 4
                        acc = wgmma_wait(mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff),
                                         1)
                    if kt > 0 and lane == 0:
                        mbarrier_arrive(smem, empty0 + 8 * ((g - 1) % stages))
                    if kt + stages - 1 < ktiles:
                        issue_slice(smem, g + stages - 1, kt + stages - 1, ring, full0, tmaps,
                                    dst0, a, w0, w1, a_src, a_nb, b_src, b_pass_elems, b_row,
                                    tid, ktiles)
                acc = wgmma_wait(acc, 0)
                if lane == 0:                      # the tile's last slice is free too
                    mbarrier_arrive(smem, empty0 + 8 * ((g0 + ktiles - 1) % stages))
                g0 += ktiles
            elif multicast:
                # Cluster ring, per slice g (block-global, stage g % STAGES): wait my A chunks
                # and full[g] (every block's share of B landed) -> block barrier (A's stage
                # reuse, as in the block ring) -> A chunks of g + PREFETCH -> MMAs on g ->
                # wgmma.wait(1): g - 1 retired -> each warp releases g - 1 in every block of
                # the cluster -> thread 0 issues B shares: g + 1 for sure, then on while the
                # stages are already free everywhere (up to g + STAGES - 1). A share is thus
                # issued as soon as the last peer released its stage, not at a fixed step.
                for kt in range(ktiles):
                    g = g0 + kt
                    st = g % stages
                    cp_async_wait(in_flight)
                    wait_phase(smem, full0 + 8 * st, (g // stages) & 1)
                    fence_proxy_async()
                    cuda.syncthreads()
                    if b_first and tid == 0:
                        b_next = issue_b_shares(smem, b_next, g0 + min(kt + 1, ktiles - 1),
                                                g0 + min(kt + min(poll_ahead, stages - 2),
                                                         ktiles - 1), ring, full0, tmaps,
                                                b_row, g0, w0, w1, ktiles * BK, rank)
                    run_mma = warp_all(active) != 0
                    soff = (st * stage_bytes) >> 4
                    if mma_first and run_mma:
                        acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                    if kt + prefetch < ktiles:
                        load_stage(smem, (g + prefetch) % stages, (kt + prefetch) * BK, ring,
                                   full0, tmaps, dst0, a, w0, w1, a_src, a_nb, b_src,
                                   b_pass_elems, b_row, tid, ktiles)
                    cp_async_commit()
                    if run_mma:
                        if not mma_first:
                            acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                        acc = wgmma_wait(acc, 1)
                    if kt > 0 and lane == 0:
                        release(smem, empty0, g - 1, rank)
                    if tid == 0:
                        b_next = issue_b_shares(smem, b_next, g0 + min(kt + 1, ktiles - 1),
                                                g0 + min(kt + poll_ahead, ktiles - 1), ring,
                                                full0, tmaps, b_row, g0, w0, w1, ktiles * BK,
                                                rank)
                acc = wgmma_wait(acc, 0)
                if lane == 0:                      # the tile's last slice is free too
                    release(smem, empty0, g0 + ktiles - 1, rank)
                cp_async_wait(0)
                cuda.syncthreads()                 # every warpgroup done with the ring
                g0 += ktiles
            else:
                cst = 0                            # ring stages of the slice computed / loaded
                lst = prefetch                     # (compare-and-wrap: no modulo in the loop)
                if staged and lane < 16:           # the last epilogue's staging (stages
                    bulk_wait_read(0)              # PREFETCH..) is read out before kt = 0
                for kt in range(ktiles):
                    cp_async_wait(in_flight)
                    if tma_b:
                        wait_phase(smem, full0 + 8 * cst, (phases >> cst) & 1)
                        phases ^= 1 << cst
                    fence_proxy_async()
                    cuda.syncthreads()
                    soff = (cst * stage_bytes) >> 4
                    # warp_all: ``active`` is uniform per warpgroup, but only a vote makes it so
                    # for ptxas -- a wgmma under a plain ``if active`` serialises them (C7518).
                    run_mma = warp_all(active) != 0
                    if mma_first and run_mma:
                        acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                    nxt = kt + prefetch
                    if nxt < ktiles:
                        load_stage(smem, lst, nxt * BK, ring, full0, tmaps, dst0, a, w0, w1,
                                   a_src, a_nb, b_src, b_pass_elems, b_row, tid, ktiles)
                    cp_async_commit()
                    if run_mma:
                        if not mma_first:
                            acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                        acc = wgmma_wait(acc, 1)
                    cst = 0 if cst == stages - 1 else cst + 1
                    lst = 0 if lst == stages - 1 else lst + 1
                acc = wgmma_wait(acc, 0)
                cp_async_wait(0)
                cuda.syncthreads()                 # every warpgroup done with the ring

            out_row = row0 + frag_row
            out_col = col0 + frag_col
            mine = owned
            stores = mine and (not no_store or K < 0)   # no_store: false at run time only
            if staged and stage_first:
                stage_and_send(smem, c, acc, out, peers, route_rank, route_token, route_slot, k,
                               n_out, limit, ring, lane, frag_row, frag_col, row0, col0, stores)
            done_row0 = row0                   # the staging below still needs this tile's
            done_col0 = col0
            t += cuda.gridDim.x // cl
            if t < total:                      # next tile's first slices: in flight now
                row0, col0, b_src, b_row, active, owned, b_next = tile_start(
                    smem, a, a_index, w0, w1, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring,
                    full0, dst0, a_src, a_nb, b_pass_elems, ld_row, ld_chunk, wg, tid, rows_cap,
                    g0, rank, b_next)
            # Epilogue: registers -> bf16 pairs -> out (all-padding warpgroups write zeros;
            # a warpgroup past the expert's rows writes nothing: they are the next expert's).
            if staged and not stage_first:
                stage_and_send(smem, c, acc, out, peers, route_rank, route_token, route_slot, k,
                               n_out, limit, ring, lane, frag_row, frag_col, done_row0,
                               done_col0, stores)
            if not staged and stores:
                store_tile(out, c, acc, out_row, out_col, n_out, limit, route_rank,
                           route_token, route_slot, peers, k)
        if staged and lane < 16:    # the last bulk stores, written before the block ends
            bulk_wait(0)
        if multicast:           # no block leaves while a peer may still arrive on its barriers
            cluster_sync()

    kernel.smem_bytes = smem_bytes(bn, stages, bm)
    kernel.threads = threads
    return kernel
