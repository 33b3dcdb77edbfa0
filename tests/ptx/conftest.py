"""sm_90 typing job: compile every GPU kernel to PTX on a machine without a GPU.

The simulator does not type-check (wrong dtypes pass there and fail on the GPU); NVVM does.
Device-function calls ask the driver for the current device's compute capability; with no
driver here we answer (9, 0) ourselves.
"""
import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    pytest.skip("PTX typing runs without the simulator", allow_module_level=True)


class _Hopper:
    compute_capability = (9, 0)


@pytest.fixture(autouse=True, scope="session")
def _no_driver_needed():
    import numba.cuda.dispatcher as dispatcher
    saved = dispatcher.get_current_device
    try:
        dispatcher.get_current_device()
    except Exception:
        dispatcher.get_current_device = lambda: _Hopper()
    yield
    dispatcher.get_current_device = saved
