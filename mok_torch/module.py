"""``MoEBlock``: the MoE layer as an ``nn.Module`` -- router, shared expert and this rank's
routed experts as parameters, autograd through ``mok_torch.moe`` -- to drop into a model where
torchtitan's or Megatron's MoE layer would go.

    block = mok_torch.MoEBlock(hidden, intermediate, shared_intermediate, num_experts, topk,
                               max_tokens=4096)               # collective at EP > 1
    y = block(x)                                                # x [T, H] or [B, S, H] bf16
    y.float().pow(2).mean().backward()                          # .grad of every parameter

Parameters (bf16; the router's float32): ``router.weight`` [E, H] (+ the buffer
``router.e_score_correction_bias`` [E]), ``w_shared_gate`` / ``w_shared_up`` [I_s, H],
``w_shared_down`` [H, I_s] (absent when I_s = 0), ``w_gate`` / ``w_up`` [E_local, I, H],
``w_down`` [E_local, H, I]: this rank's experts ``rank * E_local ...``, in order -- the
``mok_comm.layer.Weights`` names. Initialised as ``nn.Linear`` (uniform, bound fan_in^-1/2);
expert e's draws come from its own generator seeded by the global RNG and e, so seeding every
rank alike gives equal replicated parameters (router, shared expert) and distinct experts, the
same model at any EP size.

Checkpoints: ``state_dict`` holds this rank's stacked experts under the names above;
``load_state_dict`` also takes Hugging Face DeepSeek-V3 layouts -- ``experts.{e}.gate_proj.weight``
/ ``up_proj`` / ``down_proj`` (global e: this rank's are stacked, other ranks' skipped),
``shared_experts.*_proj.weight`` and ``gate.weight`` / ``gate.e_score_correction_bias``.

Gradients: bf16 ``.grad`` through autograd like any module; or, with ``main_grad=True``, the six
expert weights' gradients accumulated in float32 ``param.main_grad`` buffers straight from the
backward's GEMMs (Megatron's convention: ``.grad`` stays None for them, ``zero_main_grad()``
after the optimizer step; eager only).

Tokens: any 0 <= T <= ``max_tokens`` per call and per rank (``mok_comm.layer``: one workspace
for T_max). EP > 1: one process per GPU, ``ep_group`` the whole world (NVSHMEM spans the world);
replicated parameters (router, shared expert, the rest of the model) see only this rank's tokens,
so their gradients need the data-parallel all-reduce a trainer does anyway.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM

from .layer import Layer, Weights, dense
from .op import moe

_EXPERT_KEYS = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
_SHARED_KEYS = (("w_shared_gate", "gate_proj"), ("w_shared_up", "up_proj"),
                ("w_shared_down", "down_proj"))


class Router(nn.Module):
    """DeepSeek-V3's router: scores = score_func(x W^T) in float32, experts chosen by top-k of
    scores + ``e_score_correction_bias`` (aux-loss-free balancing: the bias steers the choice
    only; ``update_bias``), optionally within the ``topk_group`` best of ``n_group`` expert
    groups; weights = the chosen scores, normalised to sum 1 (``norm_topk_prob``), times
    ``routed_scaling_factor``. ``forward(x [T, H]) -> (topk_ids int64 [T, k], weights float32
    [T, k])``, slots in descending order of choice. Any module with that contract can replace
    it."""

    def __init__(self, hidden: int, num_experts: int, topk: int, *,
                 score_func: str = "sigmoid", bias: bool = True, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 device=None, dtype=torch.float32):
        super().__init__()
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func={score_func!r}: must be 'sigmoid' or 'softmax'")
        if (not isinstance(n_group, int) or n_group < 1 or num_experts % n_group
                or not 1 <= topk_group <= n_group):
            raise ValueError(f"n_group={n_group}, topk_group={topk_group}: n_group must divide "
                             f"num_experts={num_experts} and 1 <= topk_group <= n_group")
        if not 1 <= topk <= num_experts // n_group * topk_group:
            raise ValueError(f"topk={topk}: must be in [1, {num_experts // n_group * topk_group}]"
                             " (the experts of the chosen groups)")
        self.num_experts, self.topk, self.score_func = num_experts, topk, score_func
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(num_experts, device=device) if bias else None)
        bound = 1 / math.sqrt(hidden)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x):
        logits = nn.functional.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(-1)
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.n_group > 1:
            T = choice.shape[0]
            groups = choice.view(T, self.n_group, -1)
            group_score = groups.topk(min(2, groups.shape[-1]), -1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(self.topk_group, -1).indices, True)
            choice = groups.masked_fill(~keep.unsqueeze(-1), -math.inf).view(T, -1)
        ids = choice.topk(self.topk, -1, sorted=True).indices
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.routed_scaling_factor

    @torch.no_grad()
    def update_bias(self, topk_ids, rate: float = 1e-3, group=None) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), the
        load counted over ``topk_ids`` (-1 ignored) and, with ``group``, summed over its ranks.
        Integer counts on the device: no host sync, deterministic."""
        if self.e_score_correction_bias is None:
            raise ValueError("update_bias: this router was built with bias=False")
        ids = topk_ids.reshape(-1)
        load = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=ids.device)
        load.scatter_add_(0, torch.where(ids < 0, self.num_experts, ids),
                          torch.ones_like(ids, dtype=torch.int64))
        load = load[:-1]
        if group is not None:
            torch.distributed.all_reduce(load, group=group)
        err = load.float().mean() - load.float()
        self.e_score_correction_bias.add_(rate * err.sign())


def _device():
    return torch.device("cpu") if SIM else torch.device("cuda", torch.cuda.current_device())


def _ep(ep_group):
    """(rank, size) of this process in the EP group: the whole world, or 1 without one."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if ep_group is not None:
            raise ValueError("ep_group: given, but torch.distributed is not initialised")
        return 0, 1
    world = dist.get_world_size()
    group = ep_group if ep_group is not None else dist.group.WORLD
    if dist.get_world_size(group) != world:
        raise ValueError(f"ep_group: {dist.get_world_size(group)} ranks, but NVSHMEM spans the "
                         f"whole world ({world} processes): pass the world group (or None)")
    return dist.get_rank(group), world


class MoEBlock(nn.Module):
    """Router + shared expert + this rank's routed experts (module docstring).

    Arguments: hidden H, intermediate I, shared_intermediate I_s (0: none), num_experts E
    (global), topk k; ``ep_group`` (None: the world when torch.distributed runs, else EP 1);
    ``config`` (``MoKConfig``); ``router``: a module ``x [T, H] -> (topk_ids [T, k],
    weights [T, k] float32)`` (default ``Router(H, E, k)``); ``max_tokens``: T_max, the most
    tokens one call brings per rank; ``swiglu_limit``, ``gemm``, ``gemm_down`` as
    ``mok_comm.layer.Layer``; ``main_grad``: FP32 weight-gradient accumulation (module
    docstring).
    """

    def __init__(self, hidden: int, intermediate: int, shared_intermediate: int,
                 num_experts: int, topk: int, ep_group=None, config: MoKConfig = MoKConfig(),
                 router: nn.Module | None = None, *, max_tokens: int, swiglu_limit=None,
                 gemm=None, gemm_down=None, main_grad: bool = False):
        super().__init__()
        rank, R = _ep(ep_group)
        self.shape = LayerShape(hidden, intermediate, shared_intermediate, num_experts, topk, R)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: must be an int >= 1 (T_max)")
        self.rank, self.ep_group = rank, ep_group
        dev = _device()
        self.layer = Layer(self.shape, max_tokens, config, gemm=gemm, gemm_down=gemm_down,
                           swiglu_limit=swiglu_limit)
        self.router = router if router is not None else Router(hidden, num_experts, topk,
                                                               device=dev)
        H, I, I_s, E_l = hidden, intermediate, shared_intermediate, self.shape.experts_per_rank
        first = rank * E_l
        self.experts = range(first, first + E_l)          # this rank's global expert ids
        bf = dict(device=dev, dtype=torch.bfloat16)
        self.w_gate = nn.Parameter(torch.empty(E_l, I, H, **bf))
        self.w_up = nn.Parameter(torch.empty(E_l, I, H, **bf))
        self.w_down = nn.Parameter(torch.empty(E_l, H, I, **bf))
        for name, _ in _SHARED_KEYS:
            shp = (H, I_s) if name == "w_shared_down" else (I_s, H)
            self.register_parameter(name, nn.Parameter(torch.empty(shp, **bf)) if I_s else None)
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_hf_layout)
        self.main_grad = main_grad
        if main_grad:
            for w in self.expert_weights():
                if w is not None:
                    w.main_grad = torch.zeros_like(w, dtype=torch.float32)

    def zero_main_grad(self) -> None:
        """Zero the float32 ``main_grad`` buffers (``main_grad=True``), as after an optimizer
        step."""
        for w in self.expert_weights():
            if w is not None and hasattr(w, "main_grad"):
                w.main_grad.zero_()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s init; expert e from its own generator (module docstring)."""
        dev = self.w_gate.device
        base = int(torch.randint(0, 2 ** 62, (1,)))     # the global RNG: equal on every rank
        for j, e in enumerate(self.experts):
            g = torch.Generator(device=dev).manual_seed(base + e)
            for w in (self.w_gate, self.w_up, self.w_down):
                bound = 1 / math.sqrt(w.shape[2])
                w[j].copy_(torch.rand(w.shape[1:], generator=g, device=dev) * 2 * bound - bound)
        for w in (self.w_shared_gate, self.w_shared_up, self.w_shared_down):
            if w is not None:
                nn.init.uniform_(w, -1 / math.sqrt(w.shape[1]), 1 / math.sqrt(w.shape[1]))

    def expert_weights(self):
        """The six weights in ``mok_comm.layer.Weights`` order."""
        return (self.w_shared_gate, self.w_shared_up, self.w_shared_down, self.w_gate,
                self.w_up, self.w_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = self.shape.hidden
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"x: expected a [T, {H}] or [B, S, {H}] tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected dtype torch.bfloat16, got {x.dtype}")
        for name, w in zip(Weights._fields, self.expert_weights()):
            if w is not None and w.device != x.device:
                raise ValueError(f"{name}: a parameter on {w.device}, but x is on {x.device} "
                                 f"(rank {self.rank})")
        h = x.reshape(-1, H)
        routed = self.router(h)
        if not isinstance(routed, (tuple, list)) or len(routed) != 2:
            raise TypeError(f"router: expected it to return (topk_ids [T, k], weights [T, k]), "
                            f"got {type(routed).__name__}"
                            f"{f' of {len(routed)}' if isinstance(routed, (tuple, list)) else ''}"
                            f" (rank {self.rank})")
        topk_ids, weights = routed
        args = (h.contiguous(), topk_ids.contiguous(), weights.float().contiguous())
        if self.main_grad:
            out = _MainGradMoE.apply(self.layer, self.expert_weights(), *args,
                                     *self.expert_weights())
        else:
            out = moe(self.layer, *args, self.expert_weights())
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, shared_intermediate="
                f"{s.shared_intermediate}, experts={s.num_experts} (this rank: "
                f"{self.experts.start}..{self.experts.stop - 1}), topk={s.topk}, "
                f"max_tokens={self.layer.tokens_per_rank}")


class _MainGradMoE(torch.autograd.Function):
    """``main_grad=True``: the step with its weight gradients accumulated in FP32 straight from
    the backward's GEMMs into each weight's ``main_grad`` (``accumulate=True``: no bf16
    rounding per micro-batch, as Megatron's distributed optimizer), d_x and the router weights'
    gradient returned to autograd. Eager only: under ``torch.compile`` it is a graph break."""

    @staticmethod
    def forward(ctx, layer, params, x, topk_ids, router_weights, *weights):
        ctx.layer, ctx.params = layer, params
        x, topk_ids, router_weights = dense(x), dense(topk_ids), dense(router_weights)
        ctx.save_for_backward(x, topk_ids, router_weights, *weights)
        return layer.forward(x, topk_ids, router_weights, weights, manual=False)[0]

    @staticmethod
    def backward(ctx, d_out):
        x, topk_ids, router_weights, *weights = ctx.saved_tensors
        layer = ctx.layer
        step = layer.context_for(x, topk_ids, router_weights, weights)
        d_x, d_w = torch.empty_like(x), torch.empty_like(router_weights)
        main = [None if p is None else p.main_grad for p in ctx.params]
        layer.backward(step, dense(d_out.to(torch.bfloat16)), router_weights, weights,
                       grads=(d_x, d_w, *main), accumulate=True, manual=False)
        return (None, None, d_x, None, d_w, *(None for _ in weights))


def _hf_layout(module: MoEBlock, state_dict, prefix, *_args):
    """Hugging Face DeepSeek-V3 keys -> this module's (module docstring), in place."""
    for ours, theirs in (("router.weight", "gate.weight"),
                         ("router.e_score_correction_bias", "gate.e_score_correction_bias")):
        if prefix + theirs in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)
    for ours, theirs in _SHARED_KEYS:
        key = f"{prefix}shared_experts.{theirs}.weight"
        if key in state_dict:
            state_dict[prefix + ours] = state_dict.pop(key)
    per_expert = {}
    for key in [k for k in state_dict if k.startswith(prefix + "experts.")]:
        parts = key[len(prefix):].split(".")
        if len(parts) == 4 and parts[1].isdigit() and parts[3] == "weight":
            per_expert[(int(parts[1]), parts[2])] = state_dict.pop(key)
    if not per_expert:
        return
    error_msgs = _args[-1]              # (local_metadata, strict, missing, unexpected, errors)
    E = module.shape.num_experts
    beyond = sorted({e for e, _ in per_expert if e >= E})
    if beyond:
        error_msgs.append(f"{prefix}experts.{{e}}: the checkpoint holds experts up to "
                          f"{beyond[-1]}, but this block has num_experts={E} (rank "
                          f"{module.rank})")
    for ours, theirs in _EXPERT_KEYS:
        missing = [e for e in module.experts if (e, theirs) not in per_expert]
        if missing:
            error_msgs.append(f"{prefix}experts.{{e}}.{theirs}.weight: missing for this rank's "
                              f"experts {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"(rank {module.rank} holds {module.experts.start}.."
                              f"{module.experts.stop - 1})")
            continue
        state_dict[prefix + ours] = torch.stack([per_expert[(e, theirs)]
                                                 for e in module.experts])


__all__ = ["MoEBlock", "Router"]
