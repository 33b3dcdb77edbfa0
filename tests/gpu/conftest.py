"""GPU suite: real shapes, real kernels, several processes (torchrun or ``mok_comm.launch``).

    torchrun --standalone --nproc-per-node=2 -m pytest -q tests/gpu
    python -m mok_comm.launch --nproc 2 -- python -m pytest -q tests/gpu

Skipped entirely without a GPU (and under the simulator). Each process uses GPU LOCAL_RANK.
"""
import os

import pytest

_SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
_HAVE_GPU = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def pytest_collection_modifyitems(config, items):
    if _SIM or not _HAVE_GPU:
        skip = pytest.mark.skip(reason="GPU suite: needs a CUDA GPU and no simulator")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)


class Dist:
    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))


@pytest.fixture(scope="session")
def dist():
    from numba import cuda
    d = Dist()
    cuda.select_device(d.local_rank)
    try:
        import torch
        torch.cuda.set_device(d.local_rank)
    except ImportError:
        pass
    return d


@pytest.fixture(scope="session")
def nvshmem_world(dist):
    """NVSHMEM initialised over all processes (torch.distributed when launched by torchrun,
    the uid file when launched by mok_comm.launch)."""
    if dist.world < 2:
        pytest.skip("needs >= 2 processes (torchrun --nproc-per-node=2 or mok_comm.launch)")
    method = "env" if os.environ.get("MOK_UID_FILE") else "torch"
    if method == "torch":
        import torch.distributed as td
        if not td.is_initialized():
            td.init_process_group("cpu:gloo,cuda:nccl", device_id=None)
    from mok_comm.launch import bootstrap
    info = bootstrap.init(method)
    yield info
    bootstrap.finalize()
