"""NVSHMEM start-up for MoK: one call that turns a group of processes into NVSHMEM PEs.

`init()` finds out how the processes were launched, agrees on an NVSHMEM unique id (UID) and
calls `nvshmem.core.init(..., initializer_method="uid")` with one GPU per process. Each launch
style has its own way of passing the UID from rank 0 to the others:

======== ========================================================================================
method   where rank, world size and the UID come from
======== ========================================================================================
"torch"  an initialised `torch.distributed` process group; the UID travels with
         `torch.distributed.broadcast_object_list` (torchrun, or any torch launcher).
"mpi"    mpi4py (`mpirun -np N ...`); the pickled UID travels with `comm.bcast`.
"env"    our launcher, `python -m mok_comm.launch` (RANK, WORLD_SIZE, LOCAL_RANK, MOK_UID_FILE);
         rank 0 writes the pickled UID to MOK_UID_FILE, the others poll for it.
"single" one process, rank 0 of 1 (what "auto" falls back to when nothing else applies).
======== ========================================================================================

Rank 0 always creates the UID itself: `nvshmem.core.get_unique_id()` starts the bootstrap root
listener in the calling process, so the process that creates it must take part and stay alive.

Before NVSHMEM starts, `init()` also fixes the environment NVSHMEM reads:

* `NVSHMEM_DISABLE_NVLS=1` always (NVLink multicast must stay off on our hosts; it is never
  turned on, whatever the caller's environment says);
* on a single node, `NVSHMEM_REMOTE_TRANSPORT=none` and `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`
  unless already set (no InfiniBand probing; the UID bootstrap stays on loopback);
* stale `/tmp/nvshmem-socket-*` files left by crashed runs are deleted (`clean_stale_sockets`),
  since NVSHMEM's `bind()` on such a name fails and aborts the init.

The UID exchanges are small functions that take a `make_uid` callable and the transport
(`exchange_uid_via_file`, `exchange_uid_via_broadcast`, `exchange_uid_via_mpi`), so they are
tested on a CPU-only machine with a fake UID. nvshmem4py, cuda.core, torch and mpi4py are only
imported inside the functions that need them.

All module state lives in one object, `_STATE`.
"""
from __future__ import annotations

import os
import pickle
import re
import stat
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CommInfo", "init", "finalize", "is_initialized", "info", "exchange_uid_via_file",
           "exchange_uid_via_broadcast", "exchange_uid_via_mpi", "clean_stale_sockets",
           "apply_env_defaults", "INSTALL_HINT", "SOCKET_DIR"]

INSTALL_HINT = ("nvshmem4py is not installed: pip install 'mok-py[gpu]' "
                "(nvshmem4py-cu13==0.4.1)")

#: NVSHMEM hard-codes this directory for its FD-passing sockets (not $TMPDIR).
SOCKET_DIR = "/tmp"

DEFAULT_BOOTSTRAP_TIMEOUT_S = 120.0

_METHODS = ("auto", "torch", "mpi", "env")

# NVSHMEM (src/host/util/sockets.cpp) binds AF_UNIX datagram sockets named
# "/tmp/nvshmem-socket-<sender pid>-<receiver pid>"; the process that binds (and later unlinks)
# the file is the *receiver*, the last number. Each PE binds "<own>-<own>" plus "<peer>-<own>"
# for every P2P peer. Releases before the two-pid scheme used "/tmp/nvshmem-socket-<pid>".
_SOCKET_NAME = re.compile(r"^nvshmem-socket-(\d+)(?:-(\d+))?$")

# Environment variables set by MPI launchers; mpi4py is imported only when one is present,
# because `import mpi4py.MPI` in a process not started by mpirun runs a singleton MPI_Init,
# which is slow or fails on hosts without a working MPI runtime.
_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
                    "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class CommInfo:
    """Where this process sits in the NVSHMEM world.

    Attributes:
        rank: NVSHMEM PE number of this process (== `nvshmem.core.my_pe()`).
        world_size: number of PEs (== `nvshmem.core.n_pes()`).
        local_rank: index of this process among the processes on its node.
        device_id: CUDA device ordinal this PE is bound to.
        method: how the world was formed: "torch", "mpi", "env" or "single".
    """
    rank: int
    world_size: int
    local_rank: int
    device_id: int
    method: str


class _State:
    """The module's only mutable state (one instance, `_STATE`)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.info: Optional[CommInfo] = None    # set once nvshmem.core.init returned
        self.finalized = False                  # nvshmem.core.finalize already called
        self.uid: Any = None                    # rank 0 keeps its UID object referenced


_STATE = _State()


# --------------------------------------------------------------------------------------------
# UID exchanges (no NVSHMEM needed: `make_uid` is any zero-argument callable returning a
# picklable object; on rank 0 only it is called)
# --------------------------------------------------------------------------------------------

def _bootstrap_timeout(timeout: Optional[float]) -> float:
    if timeout is not None:
        return float(timeout)
    raw = os.environ.get("MOK_BOOTSTRAP_TIMEOUT")
    if raw:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"MOK_BOOTSTRAP_TIMEOUT={raw!r} is not a number of seconds") from None
    return DEFAULT_BOOTSTRAP_TIMEOUT_S


def exchange_uid_via_file(rank: int, path: str, make_uid: Callable[[], Any],
                          timeout: Optional[float] = None, poll_interval: float = 0.02) -> Any:
    """Share a UID through a file that every rank can see (same host or shared file system).

    Rank 0 calls `make_uid()`, pickles the result into a temporary file in the same directory
    and renames it onto `path` with `os.replace`, so a reader sees either no file or the whole
    pickle, never a partial one. The other ranks poll until `path` exists and unpickle it.
    `path` must not exist before the exchange (our launcher hands out a fresh name per run):
    a left-over file from an earlier run would be read as this run's UID.

    Arguments:
        rank: this process's rank; rank 0 creates and writes the UID.
        path: the file to write (rank 0) or wait for (others).
        make_uid: zero-argument callable returning a picklable UID; called on rank 0 only.
        timeout: seconds a non-zero rank waits for the file; None means the environment
            variable MOK_BOOTSTRAP_TIMEOUT, else 120 s.
        poll_interval: seconds between checks for the file.

    Returns:
        The UID, equal on every rank.

    Raises:
        TimeoutError: on a non-zero rank when `path` did not appear within `timeout`; the
            message names the file.
    """
    path = os.fspath(path)
    if rank == 0:
        uid = make_uid()
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".mok-uid-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(uid, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return uid

    limit = _bootstrap_timeout(timeout)
    deadline = time.monotonic() + limit
    while True:
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: NVSHMEM unique id file {path!r} did not appear within "
                f"{limit:g} s (is rank 0 running and did it reach mok_comm.launch.bootstrap.init? "
                f"raise the limit with MOK_BOOTSTRAP_TIMEOUT)")
        time.sleep(poll_interval)


def exchange_uid_via_broadcast(rank: int, broadcast: Callable[[list], Any],
                               make_uid: Callable[[], Any]) -> Any:
    """Share a UID with an in-place object broadcast from rank 0 (torch.distributed style).

    Arguments:
        rank: this process's rank within the group; rank 0 creates the UID.
        broadcast: callable taking a one-element list and replacing its element, on every
            rank, by rank 0's element -- e.g.
            `lambda box: torch.distributed.broadcast_object_list(box, src=0, group=g)`.
        make_uid: zero-argument callable returning a picklable UID; called on rank 0 only.

    Returns:
        The UID, equal on every rank.
    """
    box = [make_uid() if rank == 0 else None]
    broadcast(box)
    if box[0] is None:
        raise RuntimeError(f"rank {rank}: the UID broadcast delivered nothing")
    return box[0]


def exchange_uid_via_mpi(comm: Any, make_uid: Callable[[], Any], root: int = 0) -> Any:
    """Share a UID over an mpi4py communicator (pickled with `comm.bcast`).

    Arguments:
        comm: an mpi4py communicator, or any object with `Get_rank()` and
            `bcast(obj, root=...)` with mpi4py's semantics.
        make_uid: zero-argument callable returning a picklable UID; called on `root` only.
        root: the rank of `comm` that creates the UID.

    Returns:
        The UID, equal on every rank of `comm`.
    """
    uid = make_uid() if comm.Get_rank() == root else None
    return comm.bcast(uid, root=root)


# --------------------------------------------------------------------------------------------
# Environment and stale sockets
# --------------------------------------------------------------------------------------------

def _is_single_node(world_size: int, local_world_size: Optional[int]) -> bool:
    # Unknown locality is treated as one node: every launcher we support on a multi-node job
    # (torchrun, mpirun) reports it, and a wrong "none" would only fail loudly at init.
    return local_world_size is None or local_world_size >= world_size


def apply_env_defaults(world_size: int, local_world_size: Optional[int]) -> None:
    """Set the NVSHMEM environment this project relies on (before any NVSHMEM call).

    NVSHMEM reads these variables when the UID is created and at init, so they must be in
    `os.environ` before `get_unique_id()` on rank 0 and before `init` on every rank.

    Arguments:
        world_size: number of PEs in the job.
        local_world_size: PEs on this node, or None if unknown (then treated as one node).

    Returns:
        None. `NVSHMEM_DISABLE_NVLS` is forced to "1" (a different value is overridden with a
        warning); on a single node `NVSHMEM_REMOTE_TRANSPORT=none` and
        `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo` are set unless the caller already set them.
    """
    # NVLink multicast (NVLS) can take the shared GPUs out of service on our hosts: never on.
    old = os.environ.get("NVSHMEM_DISABLE_NVLS")
    if old is not None and old != "1":
        warnings.warn(f"NVSHMEM_DISABLE_NVLS={old!r} overridden with '1': NVLink multicast "
                      "must stay off on these hosts", RuntimeWarning, stacklevel=3)
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if _is_single_node(world_size, local_world_size):
        # All traffic is NVLink/P2P; the default remote transport (ibrc) would only probe for
        # InfiniBand devices and can fail on hosts without them.
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        # The UID root listens on an interface picked by NVSHMEM (ib*, then any non-docker,
        # non-lo); on one host loopback always works and never leaves the machine.
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True   # not a real owner: never treat as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # exists, belongs to another user
    except OverflowError:
        return False  # larger than any pid the kernel can hand out
    return True


def clean_stale_sockets(directory: str = SOCKET_DIR,
                        pid_alive: Callable[[int], bool] = _pid_alive) -> list:
    """Delete NVSHMEM FD-passing socket files whose owning process no longer exists.

    NVSHMEM names them `nvshmem-socket-<sender pid>-<receiver pid>` (older releases:
    `nvshmem-socket-<pid>`); the receiver binds the file and unlinks it when done, so it is the
    owner. A crash leaves the file behind, and a later process that gets the same pid cannot
    bind it. A file is deleted only when all of these hold: its name matches, it is a socket,
    it belongs to the current user, and its owner pid is not a running process on this host.
    Files of live processes (this one included) are never touched. Pids are checked in this
    host's pid namespace, so only the node-local directory is meaningful.

    Arguments:
        directory: where to look (NVSHMEM always uses /tmp; tests pass a temporary directory).
        pid_alive: predicate telling whether a pid is a running process (tests may replace it).

    Returns:
        The list of deleted paths (sorted).
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in sorted(names):
        m = _SOCKET_NAME.match(name)
        if m is None:
            continue
        owner = int(m.group(2) or m.group(1))
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue   # another rank on this node removed it first
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
            continue
        if pid_alive(owner):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            warnings.warn(f"could not remove stale NVSHMEM socket {path}: {e}",
                          RuntimeWarning, stacklevel=2)
    return removed


# --------------------------------------------------------------------------------------------
# Launch-style detection
# --------------------------------------------------------------------------------------------

def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _torch_dist_initialized() -> bool:
    # torch.distributed cannot be initialised unless it was imported; do not import torch
    # (seconds of start-up) just to find that out.
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    try:
        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def _mpi_world_size() -> int:
    if not any(v in os.environ for v in _MPI_LAUNCH_VARS):
        return 0
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return 0
    try:
        from mpi4py import MPI
    except Exception:
        return 0
    return MPI.COMM_WORLD.Get_size()


def _resolve_method(method: str) -> str:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, not {method!r}")
    if method != "auto":
        return method
    if _torch_dist_initialized():
        return "torch"
    if os.environ.get("MOK_UID_FILE"):
        return "env"
    if _mpi_world_size() > 1:
        return "mpi"
    world = _env_int("WORLD_SIZE")
    if world is not None and world > 1:
        # Launched as one of several ranks (e.g. torchrun) but with no transport to agree on a
        # UID: silently forming N one-PE worlds would be far worse than stopping here.
        raise RuntimeError(
            f"WORLD_SIZE={world} but no way to exchange the NVSHMEM unique id: initialise "
            "torch.distributed first, launch with `python -m mok_comm.launch`, or use mpirun")
    return "single"


@dataclass
class _Plan:
    """Who this process is, before any collective step."""
    method: str
    rank: int
    world_size: int
    local_rank: Optional[int]          # None: decide after the GPU count is known
    local_world_size: Optional[int]


def _plan(method: str, group: Any, comm: Any) -> _Plan:
    # Only local queries here (no collectives): a repeated init() uses this to compare worlds.
    if method == "torch":
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("method='torch' needs an initialised torch.distributed process "
                               "group (call torch.distributed.init_process_group first)")
        return _Plan("torch", dist.get_rank(group), dist.get_world_size(group),
                     _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"))
    if method == "mpi":
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError("method='mpi' needs mpi4py (pip install mpi4py)") from e
        c = MPI.COMM_WORLD if comm is None else comm
        return _Plan("mpi", c.Get_rank(), c.Get_size(), None, None)
    if method == "env":
        missing = [v for v in ("RANK", "WORLD_SIZE", "MOK_UID_FILE") if not os.environ.get(v)]
        if missing:
            raise RuntimeError(f"method='env' needs {', '.join(missing)} in the environment "
                               "(start the program with `python -m mok_comm.launch`)")
        return _Plan("env", _env_int("RANK"), _env_int("WORLD_SIZE"),
                     _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"))
    return _Plan("single", 0, 1, None, 1)


def _mpi_locality(comm: Any) -> tuple:
    """(local_rank, local_world_size) from a shared-memory split of `comm` (collective)."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def _import_nvshmem():
    try:
        import nvshmem.core as nvs
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return nvs


def _visible_gpu_count() -> int:
    # Ask the CUDA driver, not NVML (cuda.core.system.get_num_devices): NVML counts every GPU
    # in the machine and ignores CUDA_VISIBLE_DEVICES.
    try:
        from cuda.bindings import driver as cu
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuInit failed: {err!r}")
        err, n = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetCount failed: {err!r}")
    except Exception as e:
        raise RuntimeError(f"no CUDA GPU is visible to this process (querying the driver "
                           f"failed: {e}); NVSHMEM needs one GPU per process") from e
    if n < 1:
        raise RuntimeError("no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); NVSHMEM needs one "
                           "GPU per process")
    return int(n)


def init(method: str = "auto", *, group: Any = None, comm: Any = None,
         device: Any = None) -> CommInfo:
    """Initialise NVSHMEM for this process (collective: every rank of the job calls it).

    Steps: pick the launch style (`method`), set the NVSHMEM environment
    (`apply_env_defaults`), remove stale socket files (`clean_stale_sockets`), let rank 0
    create the UID and pass it to the others, bind the GPU and call
    `nvshmem.core.init(device=Device(d), uid=uid, rank=rank, nranks=world,
    initializer_method="uid")`.

    "auto" picks, in order: "torch" if `torch.distributed` is initialised; "env" if
    MOK_UID_FILE is set (our launcher); "mpi" if the process was started by an MPI launcher,
    mpi4py imports and COMM_WORLD has more than one rank; otherwise one process on its own
    (rank 0 of 1; but if WORLD_SIZE > 1 says there should be peers, it raises instead).

    Calling `init` again after success returns the same `CommInfo` without touching NVSHMEM,
    provided the rank and world size it finds are the same (and `device`, when given, names
    the same GPU); otherwise it raises. A process whose NVSHMEM was finalized cannot init again.

    Arguments:
        method: "auto", "torch", "mpi" or "env" (see the module docstring).
        group: torch.distributed process group for method "torch" (None: the default group).
            The UID is broadcast from the group's rank 0; with an NCCL group the current CUDA
            device must already be set, as torch requires for object broadcasts.
        comm: mpi4py communicator for method "mpi" (None: COMM_WORLD).
        device: CUDA device for this PE: an ordinal, a `cuda.core.Device`, or None for the
            local rank (LOCAL_RANK; with MPI the rank within the node; else rank modulo the
            number of visible GPUs).

    Returns:
        The `CommInfo` of this process.

    Raises:
        ImportError: nvshmem4py is missing (the message says how to install it).
        RuntimeError: no CUDA GPU is visible, the launch style is unusable, the device index is
            out of range, NVSHMEM was already initialised with a different world, or it was
            finalized earlier in this process.
        TimeoutError: method "env" and rank 0's UID file did not appear in time.
        ValueError: unknown method.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, not {method!r}")
    nvs = _import_nvshmem()
    with _STATE.lock:
        if _STATE.finalized:
            raise RuntimeError("NVSHMEM was finalized in this process and cannot be "
                               "initialised again; start a new process")
        resolved = _resolve_method(method)
        if _STATE.info is not None:
            return _same_world_or_raise(_STATE.info, _plan(resolved, group, comm), device)

        n_gpus = _visible_gpu_count()
        plan = _plan(resolved, group, comm)
        if plan.method == "mpi":
            from mpi4py import MPI
            c = MPI.COMM_WORLD if comm is None else comm
            plan.local_rank, plan.local_world_size = _mpi_locality(c)
        if plan.local_rank is None:
            plan.local_rank = plan.rank % n_gpus
        if not (0 <= plan.rank < plan.world_size):
            raise RuntimeError(f"rank {plan.rank} is outside a world of {plan.world_size}")

        from cuda.core import Device
        if device is None:
            dev = Device(plan.local_rank)
        elif hasattr(device, "device_id"):
            dev = device
        else:
            dev = Device(int(device))
        if not (0 <= dev.device_id < n_gpus):
            raise RuntimeError(f"rank {plan.rank}: CUDA device {dev.device_id} requested but "
                               f"only {n_gpus} are visible")

        apply_env_defaults(plan.world_size, plan.local_world_size)
        clean_stale_sockets(SOCKET_DIR)   # module global read at call time (tests patch it)

        uid = _exchange(nvs, plan, group, comm)
        # nvshmem.core.init does not make the device current itself, and NVSHMEM attaches to
        # the calling thread's current context; this is the same primary context that torch
        # and numba use for that device.
        dev.set_current()
        nvs.init(device=dev, uid=uid, rank=plan.rank, nranks=plan.world_size,
                 initializer_method="uid")
        _STATE.uid = uid
        _STATE.info = CommInfo(rank=plan.rank, world_size=plan.world_size,
                               local_rank=plan.local_rank, device_id=int(dev.device_id),
                               method=plan.method)
        return _STATE.info


def _exchange(nvs: Any, plan: _Plan, group: Any, comm: Any) -> Any:
    make_uid = nvs.get_unique_id
    if plan.method == "single":
        return make_uid()
    if plan.method == "env":
        return exchange_uid_via_file(plan.rank, os.environ["MOK_UID_FILE"], make_uid)
    if plan.method == "mpi":
        from mpi4py import MPI
        return exchange_uid_via_mpi(MPI.COMM_WORLD if comm is None else comm, make_uid)
    import torch.distributed as dist
    # broadcast_object_list takes a *global* source rank; the group's rank 0 may be another one.
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return exchange_uid_via_broadcast(
        plan.rank, lambda box: dist.broadcast_object_list(box, src=src, group=group), make_uid)


def _same_world_or_raise(current: CommInfo, plan: _Plan, device: Any) -> CommInfo:
    want_dev = None
    if device is not None:
        want_dev = int(device.device_id if hasattr(device, "device_id") else device)
    if ((plan.rank, plan.world_size) != (current.rank, current.world_size)
            or (want_dev is not None and want_dev != current.device_id)):
        raise RuntimeError(
            f"NVSHMEM is already initialised as rank {current.rank} of {current.world_size} on "
            f"device {current.device_id} (method {current.method!r}); a second init asked for "
            f"rank {plan.rank} of {plan.world_size}"
            + (f" on device {want_dev}" if want_dev is not None else ""))
    return current


def finalize() -> None:
    """Shut NVSHMEM down in this process (collective: every PE calls it).

    Frees nothing itself: free symmetric tensors and buffers first (nvshmem4py frees what is
    still tracked and logs a leak error). Calls `nvshmem.core.finalize()` once; later calls,
    and calls when `init` never succeeded, do nothing.

    Returns:
        None.
    """
    with _STATE.lock:
        if _STATE.info is None or _STATE.finalized:
            return
        nvs = _import_nvshmem()
        # Marked first: if finalize fails half-way, a retry could not do better and must not
        # run the library's teardown twice.
        _STATE.finalized = True
        _STATE.info = None
        _STATE.uid = None
        nvs.finalize()


def is_initialized() -> bool:
    """Whether `init` succeeded in this process and `finalize` has not run.

    Returns:
        True while NVSHMEM is usable through this module.
    """
    return _STATE.info is not None


def info() -> CommInfo:
    """The `CommInfo` recorded by `init`.

    Returns:
        This process's `CommInfo`.

    Raises:
        RuntimeError: `init` has not succeeded, or NVSHMEM was finalized.
    """
    current = _STATE.info
    if current is None:
        raise RuntimeError("mok_comm.launch.bootstrap.init() has not been called (or NVSHMEM was "
                           "finalized)")
    return current
