"""Layer shapes and the one tuning config, each validated in one place.

``LayerShape`` is *what* the layer computes (model dimensions and expert-parallel size);
``MoKConfig`` is *how* it runs (capacity, alignment, readiness granularity, dispatch mode,
spin-wait bound). Both are frozen dataclasses; ``__post_init__`` rejects bad values with a
``ValueError`` that names the field and the rule it broke. (The lower-level entry points that
take shapes as plain ints -- ``create_workspace``, ``Schedule.allocate`` -- check those ints.)

Sizes derived from them (the schedule capacity) are functions of shapes only -- never of
routing data -- so the host never needs to read token counts back from the GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


def _require(cond: bool, field: str, rule: str, value) -> None:
    if not cond:
        raise ValueError(f"{field}={value!r}: {rule}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


@dataclass(frozen=True)
class LayerShape:
    """Model dimensions of one MoE layer and its expert-parallel (EP) size.

    Attributes:
        hidden: H, model width (columns of x).
        intermediate: I, routed expert FFN width.
        shared_intermediate: I_s, shared expert FFN width (0 = no shared expert).
        num_experts: E, routed experts in total (all ranks).
        topk: k, routed experts per token.
        ep_size: R, expert-parallel ranks; rank r owns experts [r*E/R, (r+1)*E/R).
    """
    hidden: int
    intermediate: int
    shared_intermediate: int
    num_experts: int
    topk: int
    ep_size: int = 1

    def __post_init__(self):
        for f in ("hidden", "intermediate", "num_experts", "topk", "ep_size"):
            v = getattr(self, f)
            _require(_is_int(v) and v > 0, f, "must be a positive int", v)
        _require(_is_int(self.shared_intermediate) and self.shared_intermediate >= 0,
                 "shared_intermediate", "must be an int >= 0", self.shared_intermediate)
        _require(self.num_experts % self.ep_size == 0, "num_experts",
                 f"must be divisible by ep_size={self.ep_size}", self.num_experts)
        _require(self.topk <= self.num_experts, "topk",
                 f"must be <= num_experts={self.num_experts}", self.topk)
        # Rows are moved and multiplied as 16-byte vectors of bf16 (8 elements).
        _require(self.hidden % 8 == 0, "hidden", "must be a multiple of 8 (16-byte rows)",
                 self.hidden)
        _require(self.intermediate % 8 == 0, "intermediate", "must be a multiple of 8",
                 self.intermediate)
        _require(self.shared_intermediate % 8 == 0, "shared_intermediate",
                 "must be a multiple of 8", self.shared_intermediate)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def with_ep(self, ep_size: int) -> "LayerShape":
        return replace(self, ep_size=ep_size)

    def shared_flops(self, tokens: int) -> float:
        return 6.0 * tokens * self.hidden * self.shared_intermediate


# Model families from MoK's design card (shared expert as wide as a routed expert, as MoK
# requires), plus DeepSeek-V3.
PRESETS: dict[str, LayerShape] = {
    "kimi-k2.7": LayerShape(hidden=7168, intermediate=2048, shared_intermediate=2048,
                            num_experts=384, topk=8),
    "glm-5.2": LayerShape(hidden=6144, intermediate=2048, shared_intermediate=2048,
                          num_experts=256, topk=8),
    "qwen3.5-397b": LayerShape(hidden=4096, intermediate=1024, shared_intermediate=1024,
                               num_experts=512, topk=10),
    "deepseek-v4-pro": LayerShape(hidden=7168, intermediate=3072, shared_intermediate=3072,
                                  num_experts=384, topk=6),
    "deepseek-v3": LayerShape(hidden=7168, intermediate=2048, shared_intermediate=2048,
                              num_experts=256, topk=8),
}


def preset(name: str, ep_size: int = 1) -> LayerShape:
    """The named model shape at the given EP size (names: ``PRESETS`` keys)."""
    try:
        return PRESETS[name].with_ep(ep_size)
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None


DISPATCH_MODES = ("pull", "split")
ERROR_MODES = ("deferred", "sync", "trap")
PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class MoKConfig:
    """How the layer runs. Every field is checked here and nowhere else (a function that takes
    an override of one, such as ``dispatch.split_tokens``'s ``ce_share``, checks the override).

    Attributes:
        minibatch_size: rows per readiness unit: the dispatch counts the rows it has staged per
            minibatch of expert-sorted rows (the ``ready`` counters). Multiple of ``row_align``.
        capacity_factor: worst-case fraction of *all* routes (all ranks) that may land on one
            rank. Capacity = ceil(min(R, max(2, R*cf)) * T*k) rows plus alignment padding (at
            least twice the average load, as MoK does). The default 1.0 holds every route of
            every rank on one rank: it can never overflow (``Layer.nbytes`` says what that
            costs; at EP 2 any factor <= 1 gives the same capacity). Lower it to save memory
            at large EP: an overflow is then reported (``errors``), never a silent drop.
        row_align: rows of each expert are padded to a multiple of this (= GEMM M tile), so no
            M tile spans two experts. Power of two.
        spin_timeout_cycles: bound on any spin-wait in a kernel (SM clock cycles); when it
            expires the kernel records (rank, counter, expected, seen) and exits.
        fuse_combine: push expert outputs home from the down GEMM's epilogue (wgmma and FP8
            GEMMs) instead of writing y and running the combine kernel after it, and the
            backward's routed d_x rows from the d_x GEMM's; same bits. The mma.sync GEMM
            always combines separately.
        dispatch: how tokens reach the experts' ranks. "split" (default) -- the copy engine
            pulls each peer's first ``dispatch_ce_share`` of tokens (needed or not) on a side
            stream while the shared expert FFN runs on the SMs, then the SMs pull the needed
            rows among the rest; "pull" -- the SMs pull exactly the needed rows. Same staging
            rows, same ``ready`` counts, same output bits (docs/perf.md: why split is the
            default at EP 2).
        dispatch_ce_share: with ``dispatch="split"``, the share in [0, 1] of each peer's
            tokens the copy engine moves. It copies every token in that range, so at larger EP
            (fewer of a peer's tokens needed here) a lower share wastes less NVLink traffic.
        errors: how a problem the kernels record (bad expert id, capacity overflow, NaN/Inf,
            a peer that never arrives) reaches the caller (``mok_core.step_errors``):
            "deferred" -- the next call on the layer raises ``MoKError`` naming the step, no
            host sync; "sync" -- every step waits for its report and raises at once
            (debugging); "trap" -- the step's kernels abort the CUDA context at once.
        precision: the routed experts' GEMMs. "bf16" (default); "fp8" -- e4m3 with
            DeepSeek-V3's block scales (Hopper): tokens still travel bf16 and are quantised
            once they have landed, the weights come quantised (``mok_comm.layer.WeightsFP8``),
            the shared expert stays bf16 (docs/design.md, FP8). The backward's two routed data
            gradients run in FP8 too (on the weights' transposed copies).
        fp8_wgrad: with ``precision="fp8"``, whether the backward's routed weight gradients
            run in FP8 as well (DeepSeek-V3's: their operands quantised along the tokens, each
            expert's rows from a multiple of 128 -- ``mok_core.wgrad_rows``). None (default):
            where they pay -- where the layer's experts take more than two 128-row K slices at
            its step size (EP x tokens per rank x k / E > 256 rows); below that, with their
            operands' quantisations, they lose to bf16 (docs/perf.md, FP8) --, else bf16.
            True / False: always / never. They add e4m3's rounding to the weight gradients
            (TransformerEngine's recipes run wgrad in FP8 too, with
            ``override_linear_precision`` to keep it in bf16). ``Layer.fp8_wgrad`` says
            what a layer runs.
    """
    minibatch_size: int = 4096
    capacity_factor: float = 1.0
    row_align: int = 64
    spin_timeout_cycles: int = 1 << 34      # ~9 s at 1.98 GHz: far above any legitimate wait
    fuse_combine: bool = True
    dispatch: str = "split"
    dispatch_ce_share: float = 1.0
    errors: str = "deferred"
    precision: str = "bf16"
    fp8_wgrad: bool | None = None

    def __post_init__(self):
        _require(_is_int(self.row_align) and _is_pow2(self.row_align)
                 and self.row_align <= 1024, "row_align", "must be a power of two <= 1024",
                 self.row_align)
        _require(_is_int(self.minibatch_size) and self.minibatch_size > 0
                 and self.minibatch_size % self.row_align == 0, "minibatch_size",
                 f"must be a positive multiple of row_align={self.row_align}",
                 self.minibatch_size)
        cf = self.capacity_factor
        _require(isinstance(cf, (int, float)) and not isinstance(cf, bool)
                 and math.isfinite(cf) and 0.0 < cf <= 1.0, "capacity_factor",
                 "must be a number in (0, 1]", cf)
        _require(_is_int(self.spin_timeout_cycles) and 0 < self.spin_timeout_cycles < 1 << 62,
                 "spin_timeout_cycles", "must be a positive int below 2**62",
                 self.spin_timeout_cycles)
        _require(isinstance(self.fuse_combine, bool), "fuse_combine", "must be a bool",
                 self.fuse_combine)
        _require(self.dispatch in DISPATCH_MODES, "dispatch",
                 f"must be one of {DISPATCH_MODES}", self.dispatch)
        _require(self.errors in ERROR_MODES, "errors", f"must be one of {ERROR_MODES}",
                 self.errors)
        _require(self.precision in PRECISIONS, "precision", f"must be one of {PRECISIONS}",
                 self.precision)
        _require((self.fp8_wgrad is None or isinstance(self.fp8_wgrad, bool))
                 and (self.precision == "fp8" or not self.fp8_wgrad), "fp8_wgrad",
                 "must be None or a bool, True only with precision='fp8'", self.fp8_wgrad)
        share = self.dispatch_ce_share
        _require(isinstance(share, (int, float)) and not isinstance(share, bool)
                 and 0.0 <= share <= 1.0, "dispatch_ce_share", "must be a number in [0, 1]",
                 share)

    def schedule_capacity(self, tokens_per_rank: int, topk: int, ep_size: int,
                          experts_per_rank: int) -> int:
        """Rows of the per-rank expert-sorted schedule (a function of shapes only).

        Worst case for the given ``capacity_factor`` plus the padding every local expert may
        need, rounded up to ``row_align``.
        """
        load = min(float(ep_size), max(2.0, ep_size * self.capacity_factor))
        routed = math.ceil(load * tokens_per_rank * topk)
        rows = routed + experts_per_rank * (self.row_align - 1)
        return -(-rows // self.row_align) * self.row_align
