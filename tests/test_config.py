import dataclasses
import math

import pytest

from mok_core.config import PRESETS, LayerShape, MoKConfig, preset


def test_defaults_valid():
    cfg = MoKConfig()
    assert cfg.minibatch_size % cfg.row_align == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"row_align": 96}, "row_align"),
    ({"minibatch_size": 100}, "minibatch_size"),
    ({"dispatch": "push"}, "dispatch"),
    ({"capacity_factor": 0.0}, "capacity_factor"),
    ({"capacity_factor": 1.5}, "capacity_factor"),
    ({"capacity_factor": math.nan}, "capacity_factor"),
    ({"spin_timeout_cycles": 0}, "spin_timeout_cycles"),
    ({"spin_timeout_cycles": True}, "spin_timeout_cycles"),
    ({"dispatch": "copy"}, "dispatch"),
    ({"dispatch_ce_share": 1.5}, "dispatch_ce_share"),
    ({"dispatch_ce_share": math.nan}, "dispatch_ce_share"),
    ({"dispatch_ce_share": True}, "dispatch_ce_share"),
    ({"fp8_wgrad": True}, "fp8_wgrad"),                      # FP8 weight gradients, bf16 layer
    ({"precision": "fp8", "fp8_wgrad": 1}, "fp8_wgrad"),
    ({"precision": "fp8", "fp8_wgrad": "auto"}, "fp8_wgrad"),
])
def test_config_rejects_with_field_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MoKConfig(**kwargs)


@pytest.mark.parametrize("share", [0, 1, 0.25, 1.0])
def test_config_accepts_ce_share_bounds(share):
    assert MoKConfig(dispatch="split", dispatch_ce_share=share).dispatch_ce_share == share


@pytest.mark.parametrize("name, ep, tokens, fp8_wgrad, on", [
    ("qwen3.5-397b", 2, 4096, None, False),     # 160 rows an expert: two K slices
    ("qwen3.5-397b", 2, 8192, None, True),      # 320: three
    ("deepseek-v4-pro", 2, 8192, None, False),  # 256: two, exactly
    ("kimi-k2.7", 2, 8192, None, True),         # 341.3
    ("qwen3.5-397b", 1, 16384, None, True),     # EP 1 at 2T: EP 2's rows at T
    ("qwen3.5-397b", 2, 4096, True, True),      # forced either way
    ("qwen3.5-397b", 2, 8192, False, False),
    ("qwen3.5-397b", 2, 8192, "bf16", False),   # a bf16 layer never
])
def test_fp8_wgrad_resolves_where_it_pays(name, ep, tokens, fp8_wgrad, on):
    """``MoKConfig.fp8_wgrad`` None: FP8 weight gradients where an expert's rows (EP x T x k
    / E) take more than two 128-row K slices (``Layer.fp8_wgrad``, ``fp8_wgrad_on``)."""
    from mok_comm.layer import fp8_wgrad_on
    cfg = (MoKConfig() if fp8_wgrad == "bf16"
           else MoKConfig(precision="fp8", fp8_wgrad=fp8_wgrad))
    assert fp8_wgrad_on(preset(name, ep_size=ep), cfg, tokens) is on


def test_config_frozen():
    cfg = MoKConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.row_align = 64


@pytest.mark.parametrize("R", [1, 2, 8])
def test_capacity_bounds(R):
    cfg = MoKConfig(capacity_factor=1.0, row_align=128)
    T, k, E_local = 4096, 8, 384 // R
    cap = cfg.schedule_capacity(T, k, R, E_local)
    # cf=1.0: every route of every rank plus worst-case padding fits.
    assert cap >= R * T * k + E_local * 127 and cap % 128 == 0
    half = MoKConfig(capacity_factor=0.5).schedule_capacity(T, k, R, E_local)
    assert half >= min(R, 2) * T * k          # at least twice the average load (or all of it)
    assert half <= cap


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name):
    s = preset(name, ep_size=2)
    assert s.ep_size == 2 and s.experts_per_rank * 2 == s.num_experts
    assert s.shared_intermediate == s.intermediate


def test_preset_values():
    k = preset("kimi-k2.7")
    assert (k.hidden, k.intermediate, k.num_experts, k.topk) == (7168, 2048, 384, 8)
    d = preset("deepseek-v3")
    assert (d.hidden, d.intermediate, d.num_experts, d.topk) == (7168, 2048, 256, 8)
    q = preset("qwen3.5-397b")
    assert (q.hidden, q.intermediate, q.num_experts, q.topk) == (4096, 1024, 512, 10)
    assert preset("deepseek-v4-pro").topk == 6 and preset("glm-5.2").hidden == 6144
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


@pytest.mark.parametrize("kwargs, field", [
    ({"num_experts": 10, "ep_size": 4}, "num_experts"),
    ({"topk": 0}, "topk"),
    ({"topk": 20, "num_experts": 16}, "topk"),
    ({"hidden": 100}, "hidden"),
    ({"shared_intermediate": -8}, "shared_intermediate"),
])
def test_shape_rejects(kwargs, field):
    base = dict(hidden=64, intermediate=32, shared_intermediate=32, num_experts=16, topk=4,
                ep_size=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        LayerShape(**base)
