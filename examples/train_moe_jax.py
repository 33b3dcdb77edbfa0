"""Train the MoE layer from JAX: a router in JAX, the experts in ``mok_jax_adapter.Layer``,
``jax.grad`` through both, Adam written out (optax is not a dependency).

    python examples/train_moe_jax.py [steps] [--fp8]    # one GPU, else the CUDA simulator

The task is synthetic: fit y = tanh(x M) for a fixed random M on fresh Gaussian tokens each
step. The loss printed per step falls. On the simulator the shape is tiny and a step takes
about 20 s (the kernels run in Python); on a GPU it is a small real layer. ``--fp8``: the
layer in ``MoKConfig(precision="fp8")``, its routed weights quantised inside the jitted step
(``mok_jax_adapter.quantize_weights``, once per step; the gradients are the bf16 weights').
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a clone's
GPU = os.path.exists("/dev/nvidia0")
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave memory to the layer

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mok_jax_adapter  # noqa: E402
from mok_core.config import LayerShape, MoKConfig  # noqa: E402
from mok_core.cuda_compat import SIM  # noqa: E402

FP8 = "--fp8" in sys.argv
PRECISION = "fp8" if FP8 else "bf16"
if SIM:
    jax.config.update("jax_platforms", "cpu")      # the simulator's "device" is the host
    T, STEPS, LR = 32, 20, 1e-2
    CFG = MoKConfig(row_align=32, minibatch_size=64, precision=PRECISION)
    H_, I_ = (128, 128) if FP8 else (64, 32)      # FP8: H and I multiples of 128
    SHAPE = LayerShape(hidden=H_, intermediate=I_, shared_intermediate=I_, num_experts=4,
                       topk=2, ep_size=1)
else:
    T, STEPS, LR, CFG = 2048, 50, 3e-3, MoKConfig(precision=PRECISION)
    SHAPE = LayerShape(hidden=1024, intermediate=512, shared_intermediate=512, num_experts=16,
                       topk=4, ep_size=1)
H, I, I_s, E, K = (SHAPE.hidden, SHAPE.intermediate, SHAPE.shared_intermediate,
                   SHAPE.num_experts, SHAPE.topk)


def init_params(key):
    """float32 master weights (the layer gets them in bf16): router [H, E] and the experts."""
    ks = jax.random.split(key, 7)
    n = lambda k, shape, fan_in: jax.random.normal(k, shape) * fan_in ** -0.5  # noqa: E731
    experts = mok_jax_adapter.Weights(n(ks[0], (I_s, H), H), n(ks[1], (I_s, H), H),
                                      n(ks[2], (H, I_s), I_s), n(ks[3], (E, I, H), H),
                                      n(ks[4], (E, I, H), H), n(ks[5], (E, H, I), I))
    return {"router": n(ks[6], (H, E), H), "experts": experts}


def route(w_router, x):
    """Sigmoid scores, the top k experts, their scores normalised to sum 1."""
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ w_router)
    top, ids = jax.lax.top_k(scores, K)
    return ids, top / top.sum(-1, keepdims=True)


def main():
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG)
    key, data_key = jax.random.split(jax.random.PRNGKey(0))
    teacher = jax.random.normal(jax.random.PRNGKey(1), (H, H)) * H ** -0.5
    params = init_params(key)
    adam = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}

    def loss_fn(params, x, y):
        ids, weights = route(params["router"], x)
        experts = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params["experts"])
        if FP8:                                   # once per step, no gradient through it
            experts = mok_jax_adapter.WeightsFP8(*experts,
                                                 mok_jax_adapter.quantize_weights(experts))
        out = layer(x, ids, weights, experts)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    @jax.jit
    def train_step(params, adam, t, key):
        x = jax.random.normal(key, (T, H))
        y = jnp.tanh(x @ teacher)
        loss, grads = jax.value_and_grad(loss_fn)(params, x.astype(jnp.bfloat16), y)
        b1, b2 = 0.9, 0.999                       # Adam, bias-corrected
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, adam["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, adam["v"], grads)
        lr = LR * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, m, v)
        return params, {"m": m, "v": v}, loss

    where = "GPU" if not SIM else "the CUDA simulator"
    print(f"training the MoE layer ({PRECISION}) through JAX on {where}: {T} tokens/step, "
          f"H={H}, I={I}, I_s={I_s}, {E} experts, top-{K}")
    losses = []
    counts = [a for a in sys.argv[1:] if a != "--fp8"]
    steps = int(counts[0]) if counts else STEPS
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        params, adam, loss = train_step(params, adam, t, jax.random.fold_in(data_key, t))
        layer.check(loss)                         # waits for the step, raises MoKError
        losses.append(float(loss))
        print(f"step {t:3d}  loss {losses[-1]:.5f}  ({time.perf_counter() - t0:.2f} s)")
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
