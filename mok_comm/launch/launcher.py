"""Start one process per GPU on this host: ``python -m mok_comm.launch --nproc N -- cmd ...``.

Every child runs the same command with its own rank in the environment:

* ``RANK``, ``LOCAL_RANK`` = 0..N-1, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = N (one node);
* ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, so torch programs can call
  ``torch.distributed.init_process_group`` with the default ``env://`` rendezvous;
* ``MOK_UID_FILE``: a fresh path (in a private temporary directory, deleted when the launcher
  exits) through which `mok_comm.launch.bootstrap.init` on rank 0 hands the NVSHMEM unique id
  to the other ranks;
* ``NVSHMEM_DISABLE_NVLS=1``, ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
  whatever the launcher's own environment says (NVLink multicast stays off on our hosts).

GPUs are not hidden from the children: each child sees every GPU, so peers can map each other's
memory over NVLink/P2P, and uses GPU ``LOCAL_RANK``. ``--devices 2,3`` sets
``CUDA_VISIBLE_DEVICES`` to exactly that list (indices into the launcher's own visible set),
the same for every child, so ``LOCAL_RANK`` i means the i-th listed GPU and all of them remain
mutually visible.

The launcher waits for all children. When one exits with a non-zero code, it sends SIGTERM to
the others (to each child's process group, so shells and their subprocesses go too), SIGKILL
after ``--grace`` seconds, and exits with that code (128+n for a child killed by signal n).
SIGINT/SIGTERM (and SIGHUP) received by the launcher are forwarded the same way (exit code
128+signal), ``--timeout`` ends the whole job with exit code 124, and on Linux a child is
killed if the launcher itself dies.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional, Sequence

__all__ = ["main", "child_env", "free_port"]

_POLL_S = 0.05
_TAG = "[mok_comm.launch]"

# Forced in every child: NVLink multicast (NVSHMEM NVLS, NCCL NVLS, torch symmetric-memory
# multicast) can take the shared GPUs out of service on our hosts.
_FORCED_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it).

    Arguments:
        host: interface address to probe.

    Returns:
        The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _visible_devices(devices: Optional[Sequence[int]], base: Optional[str]) -> Optional[str]:
    # --devices indexes the launcher's own visible set, like CUDA does for any process.
    if devices is None:
        return None
    if base is not None and base.strip() != "":
        entries = [e.strip() for e in base.split(",") if e.strip() != ""]
        out = []
        for d in devices:
            if not 0 <= d < len(entries):
                raise ValueError(f"--devices index {d} is outside CUDA_VISIBLE_DEVICES={base!r}")
            out.append(entries[d])
        return ",".join(out)
    return ",".join(str(d) for d in devices)


def child_env(rank: int, nproc: int, port: int, uid_file: str,
              devices: Optional[Sequence[int]] = None, base: Optional[dict] = None) -> dict:
    """The environment of child `rank` (see the module docstring for each variable).

    Arguments:
        rank: the child's rank (also its LOCAL_RANK: the launcher runs one node).
        nproc: number of children.
        port: MASTER_PORT.
        uid_file: MOK_UID_FILE.
        devices: optional GPU list for CUDA_VISIBLE_DEVICES (indices into the base set).
        base: environment to start from (default: the launcher's own).

    Returns:
        A new dict.
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "MOK_UID_FILE": uid_file,
    })
    env.update(_FORCED_ENV)
    visible = _visible_devices(devices, env.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    # Children print through pipes when tagged; unbuffered keeps ranks' lines timely.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mok_comm.launch",
        description="Run a command once per GPU on this host with RANK/WORLD_SIZE/LOCAL_RANK/"
                    "MOK_UID_FILE set, for mok_comm.launch.bootstrap.init().",
        usage="%(prog)s --nproc N [--devices 0,1,...] [--timeout S] [--grace S] "
              "[--tag-output] -- command [args ...]")
    p.add_argument("--nproc", type=int, required=True, help="number of processes (one per GPU)")
    p.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   default=None, help="GPU indices to expose to every child, in rank order")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which the whole job is stopped (exit code 124)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping children")
    p.add_argument("--tag-output", action="store_true",
                   help="prefix every output line with [rank i]")
    if "--" in argv:
        cut = argv.index("--")
        args = p.parse_args(argv[:cut])
        args.command = argv[cut + 1:]
    else:
        p.add_argument("command", nargs=argparse.REMAINDER)
        args = p.parse_args(argv)
    if not args.command:
        p.error("no command given (put it after --)")
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    if args.devices is not None and len(args.devices) < args.nproc:
        p.error(f"--devices lists {len(args.devices)} GPUs for {args.nproc} processes")
    return args


class _Output:
    """Copies children's pipes to the launcher's stdout/stderr, one tagged line at a time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []

    def pump(self, pipe, target, prefix: bytes) -> None:
        t = threading.Thread(target=self._run, args=(pipe, target, prefix), daemon=True)
        t.start()
        self.threads.append(t)

    def _run(self, pipe, target, prefix: bytes) -> None:
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                self._write(target, prefix + line)
        finally:
            pipe.close()

    def _write(self, target, data: bytes) -> None:
        with self.lock:
            buf = getattr(target, "buffer", None)
            if buf is not None:
                buf.write(data)
            else:   # a text-only stream (e.g. a test's capture object)
                target.write(data.decode(errors="replace"))
            target.flush()

    def join(self, timeout: float) -> None:
        # A grandchild that inherited a pipe can keep it open after its parent died; do not
        # hang on it (the threads are daemons).
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # Only children not yet reaped: their pid (= process-group id, start_new_session) cannot
    # have been reused by an unrelated process.
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent():
    """A preexec_fn that makes a child get SIGKILL if the launcher dies (Linux), else None.

    Children run in their own sessions, so nothing else would stop them if the launcher were
    killed with SIGKILL (or crashed) and they would keep their GPUs busy.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def on_fork():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))
        if os.getppid() != parent:   # the launcher died before prctl took effect
            os._exit(1)
    return on_fork


def _exit_code(rc: int) -> int:
    return rc if rc >= 0 else 128 + (-rc)


def _log(msg: str) -> None:
    print(f"{_TAG} {msg}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the launcher.

    Arguments:
        argv: arguments without the program name (default: ``sys.argv[1:]``), e.g.
            ``["--nproc", "2", "--", "python", "train.py"]``.

    Returns:
        0 when every child exited with 0; the first failing child's code (128+n if killed by
        signal n); 124 after ``--timeout``; 128+n after the launcher received signal n.
    """
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    workdir = tempfile.mkdtemp(prefix="mok-launch-")
    # The file itself is created by rank 0; it must not exist before (bootstrap reads any
    # existing file as this run's UID).
    uid_file = os.path.join(workdir, "nvshmem-uid.pkl")
    port = free_port()

    received: List[int] = []

    def on_signal(signum, _frame):
        received.append(signum)   # acted on in the wait loop, outside the handler

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        # SIGHUP too: children have their own sessions and would not see a closed terminal.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)

    procs: List[subprocess.Popen] = []
    output = _Output()
    try:
        on_fork = _die_with_parent()
        for rank in range(args.nproc):
            pipe = subprocess.PIPE if args.tag_output else None
            try:
                proc = subprocess.Popen(
                    args.command, env=child_env(rank, args.nproc, port, uid_file, args.devices),
                    stdout=pipe, stderr=pipe,
                    # Own session: the launcher alone receives terminal signals and forwards
                    # them once, and a child's whole process tree can be signalled.
                    start_new_session=True, preexec_fn=on_fork)
            except (OSError, subprocess.SubprocessError) as e:
                _log(f"could not start rank {rank}: {e}")
                for p in procs:
                    _signal_group(p, signal.SIGKILL)
                for p in procs:
                    p.wait()
                return 127 if isinstance(e, FileNotFoundError) else 126
            procs.append(proc)
        # Reader threads start only after every fork: preexec_fn is unsafe while other
        # threads run. The pipes buffer the first output meanwhile.
        if args.tag_output:
            for rank, proc in enumerate(procs):
                prefix = f"[rank {rank}] ".encode()
                output.pump(proc.stdout, sys.stdout, prefix)
                output.pump(proc.stderr, sys.stderr, prefix)

        code = _wait(procs, args, received)
        output.join(timeout=2.0)
        return code
    finally:
        for p in procs:   # only reached with live children if the launcher itself failed
            _signal_group(p, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(procs: List[subprocess.Popen], args: argparse.Namespace, received: List[int]) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    failure: Optional[int] = None
    timed_out = False
    stopping_since: Optional[float] = None
    killed = False
    forwarded = 0

    def stop(sig: int) -> None:
        nonlocal stopping_since
        for p in procs:
            _signal_group(p, sig)
        if stopping_since is None:
            stopping_since = time.monotonic()

    while True:
        running = False
        for rank, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                running = True
            elif rc != 0 and failure is None and stopping_since is None:
                # Children we stop ourselves also exit non-zero; only the first one that
                # failed on its own decides the launcher's exit code.
                failure = _exit_code(rc)
                how = f"code {rc}" if rc > 0 else f"signal {-rc}"
                _log(f"rank {rank} exited with {how}; stopping the other ranks")
        if not running:
            break
        if failure is not None and stopping_since is None:
            stop(signal.SIGTERM)
        while forwarded < len(received):
            sig = received[forwarded]
            forwarded += 1
            _log(f"received {signal.Signals(sig).name}; forwarding to all ranks")
            stop(sig)
        if deadline is not None and not timed_out and time.monotonic() >= deadline:
            timed_out = True
            _log(f"--timeout {args.timeout:g} s reached; stopping all ranks")
            stop(signal.SIGTERM)
        if (stopping_since is not None and not killed
                and time.monotonic() - stopping_since >= args.grace):
            killed = True
            stop(signal.SIGKILL)
        time.sleep(_POLL_S)

    if failure is not None:
        return failure
    if timed_out:
        return 124
    if received:
        return 128 + int(received[0])
    return 0

