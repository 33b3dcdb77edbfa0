"""What makes the host wait for the device during a step, or launch a kernel the slow way (GPU).

    with host_waits.watch() as seen:          # seen: a list of str, in order
        layer.backward(layer.forward(x, ids, w, W)[1], d_out, w, W, grads=grads)
    assert not seen

Patches, while inside, numba's driver calls that can stall the host -- a device allocation,
a context / stream / event synchronise, a host-to-device copy (from pageable memory it can
wait for the stream), a device-to-host copy on no stream -- and ``mok_core.launcher.launch``
(a launch it hands to numba's dispatcher is listed: that path costs several times the host
time). numba's device arrays call these through the module and class attributes patched
here, so nothing of numba's escapes; torch's own synchronising ops are torch's
``set_sync_debug_mode``'s to see, and NVSHMEM's host calls are not looked at. A CUDA-graph
capture already proves a step's launches never wait; this covers the eager step's own host
code (error polling, caches, views). ``around(what)``, a context manager factory (e.g. a
profiler range), wraps each such call as well. Everything is restored on the way out.
"""
from __future__ import annotations

import contextlib


def kernel_label(kernel) -> str:
    """A numba kernel's Python name, a factory's closures as ``factory.kernel``."""
    py = getattr(kernel, "py_func", None)
    return getattr(py, "__qualname__", repr(kernel)).replace("<locals>.", "")


@contextlib.contextmanager
def watch(around=None):
    """Inside: the list yielded names, in order, each call described in the module docstring;
    ``around(what)`` -- a context manager factory -- wraps each of them."""
    from numba.cuda.cudadrv import driver as drv

    from mok_core import launcher
    seen: list = []

    def note(what, orig, *a, **k):
        seen.append(what)
        if around is None:
            return orig(*a, **k)
        with around(what):
            return orig(*a, **k)

    def always(what):
        return lambda orig: lambda *a, **k: note(what, orig, *a, **k)

    def no_stream(what):
        def wrap(orig):
            def inner(dst, src, size, stream=0):
                if stream:
                    return orig(dst, src, size, stream)
                return note(what, orig, dst, src, size, stream)
            return inner
        return wrap

    def lean(orig):
        def inner(kernel, *rest):
            ran = orig(kernel, *rest)
            if not ran and launcher.ENABLED:
                seen.append(f"numba's dispatcher launched {kernel_label(kernel)}")
            return ran
        return inner

    patches = [(drv.Context, "memalloc", always("a device allocation")),
               (drv.Context, "synchronize", always("a context synchronise")),
               (drv.Stream, "synchronize", always("a stream synchronise")),
               (drv.Event, "synchronize", always("an event synchronise")),
               (drv, "host_to_device", always("a host-to-device copy")),
               (drv, "device_to_host", no_stream("a device-to-host copy on no stream")),
               (launcher, "launch", lean)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for (obj, name, wrap), (_, _, orig) in zip(patches, saved):
            setattr(obj, name, wrap(orig))
        yield seen
    finally:
        for obj, name, orig in saved:
            setattr(obj, name, orig)
