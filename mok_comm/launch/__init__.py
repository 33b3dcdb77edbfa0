"""Process runtime: start one process per GPU (``python -m mok_comm.launch --nproc N -- cmd``,
``launcher``) and turn the processes into NVSHMEM PEs (``bootstrap.init``)."""
from .launcher import child_env, free_port, main

__all__ = ["child_env", "free_port", "main"]
