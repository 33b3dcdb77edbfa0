"""CPU tests of mok_comm.launch and mok_comm.launch.bootstrap (no GPU, no nvshmem4py).

The launcher is run as a real `python -m mok_comm.launch` process with small Python children;
the UID exchanges run with fake UIDs (random bytes) over real files, stub broadcasts and stub
MPI communicators; `init()` itself is checked against a fake `nvshmem.core` module.
"""
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import types

import pytest

from mok_comm.launch import bootstrap
from mok_comm.launch.bootstrap import (CommInfo, clean_stale_sockets, exchange_uid_via_broadcast,
                                exchange_uid_via_file, exchange_uid_via_mpi)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


# Child-side helper: the pid file appears complete or not at all (the test polls for it).
_WRITE_PID = """
import os
def write_pid(d):
    p = os.path.join(d, "pid" + os.environ["RANK"])
    open(p + ".tmp", "w").write(str(os.getpid()))
    os.replace(p + ".tmp", p)
"""


def _launch(launcher_args, snippet, timeout=30, **extra_env):
    """Run the launcher on `python -c snippet` (with `write_pid(dir)` defined); returns
    (CompletedProcess, seconds)."""
    cmd = [sys.executable, "-m", "mok_comm.launch", *launcher_args,
           "--", sys.executable, "-c", _WRITE_PID + textwrap.dedent(snippet)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=_env(**extra_env), capture_output=True, text=True,
                         timeout=timeout)
    return res, time.monotonic() - t0


def _tagged(stdout):
    """{rank: [lines]} from --tag-output output."""
    out = {}
    for line in stdout.splitlines():
        assert line.startswith("[rank "), line
        tag, _, rest = line.partition("] ")
        out.setdefault(int(tag[len("[rank "):]), []).append(rest)
    return out


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------ launcher

def test_launcher_child_environment():
    snippet = """
        import json, os
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "MOK_UID_FILE", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "CUDA_VISIBLE_DEVICES"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
    """
    # The launcher must override an NVLS setting inherited from its own environment.
    res, _ = _launch(["--nproc", "3", "--tag-output"], snippet, NVSHMEM_DISABLE_NVLS="0",
                     NCCL_NVLS_ENABLE="1", CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0, res.stderr
    by_rank = _tagged(res.stdout)
    assert sorted(by_rank) == [0, 1, 2]
    envs = {r: json.loads(lines[0]) for r, lines in by_rank.items()}
    for r, e in envs.items():
        assert e["RANK"] == str(r) and e["LOCAL_RANK"] == str(r)
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3"
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["NVSHMEM_DISABLE_NVLS"] == "1"
        assert e["NCCL_NVLS_ENABLE"] == "0"
        assert e["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert e["CUDA_VISIBLE_DEVICES"] == ""      # untouched without --devices
    assert len({e["MOK_UID_FILE"] for e in envs.values()}) == 1
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    uid_file = envs[0]["MOK_UID_FILE"]
    assert not os.path.exists(os.path.dirname(uid_file))   # deleted when the launcher exits


def test_launcher_devices_maps_through_visible_set():
    snippet = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    res, _ = _launch(["--nproc", "2", "--devices", "1,3", "--tag-output"], snippet,
                     CUDA_VISIBLE_DEVICES="4,5,6,7")
    assert res.returncode == 0, res.stderr
    assert _tagged(res.stdout) == {0: ["5,7"], 1: ["5,7"]}


def test_launcher_failure_stops_the_others(tmp_path):
    snippet = f"""
        import os, sys, time
        rank = int(os.environ["RANK"])
        d = {str(tmp_path)!r}
        write_pid(d)
        if rank == 1:
            # fail only once the sleepers are up, so the test can check they get stopped
            end = time.time() + 10
            while time.time() < end and not all(
                    os.path.exists(os.path.join(d, f"pid{{r}}")) for r in (0, 2)):
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(60)
    """
    res, elapsed = _launch(["--nproc", "3", "--grace", "2"], snippet)
    assert res.returncode == 3, res.stderr
    assert elapsed < 10
    assert "rank 1 exited with code 3" in res.stderr
    for r in range(3):
        pid = int((tmp_path / f"pid{r}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_sigterm_is_escalated_to_sigkill(tmp_path):
    # A child that ignores SIGTERM is killed after --grace.
    snippet = f"""
        import os, signal, sys, time
        rank = int(os.environ["RANK"])
        write_pid({str(tmp_path)!r})
        if rank == 0:
            time.sleep(0.5)
            sys.exit(5)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """
    res, elapsed = _launch(["--nproc", "2", "--grace", "1"], snippet)
    assert res.returncode == 5, res.stderr
    assert elapsed < 10
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid1").read_text()), 0)


def test_launcher_timeout():
    res, elapsed = _launch(["--nproc", "2", "--timeout", "1", "--grace", "1"],
                           "import time; time.sleep(60)")
    assert res.returncode == 124
    assert elapsed < 10


def test_launcher_forwards_sigterm(tmp_path):
    snippet = f"""
        import os, time
        write_pid({str(tmp_path)!r})
        time.sleep(60)
    """
    cmd = [sys.executable, "-m", "mok_comm.launch", "--nproc", "2", "--grace", "2", "--",
           sys.executable, "-c", _WRITE_PID + textwrap.dedent(snippet)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 10
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert time.monotonic() < end, "children did not start"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert rc == 128 + signal.SIGTERM
    for r in range(2):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid{r}").read_text()), 0)


def _gone(pid):
    """True when pid is no process or a zombie (an orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_children_die_with_a_killed_launcher(tmp_path):
    snippet = f"""
        import os, time
        write_pid({str(tmp_path)!r})
        time.sleep(60)
    """
    cmd = [sys.executable, "-m", "mok_comm.launch", "--nproc", "2", "--",
           sys.executable, "-c", _WRITE_PID + textwrap.dedent(snippet)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=_env())
    try:
        end = time.monotonic() + 10
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert time.monotonic() < end, "children did not start"
            time.sleep(0.02)
    finally:
        launcher.kill()
        launcher.wait()
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    end = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    assert all(_gone(p) for p in pids)


def test_launcher_requires_command():
    from mok_comm.launch import main
    with pytest.raises(SystemExit) as e:
        main(["--nproc", "2"])
    assert e.value.code == 2


# ------------------------------------------------------------------------------- UID exchanges

def test_uid_file_exchange_between_launched_processes():
    snippet = """
        import os
        from mok_comm.launch.bootstrap import exchange_uid_via_file
        uid = exchange_uid_via_file(int(os.environ["RANK"]), os.environ["MOK_UID_FILE"],
                                    lambda: os.urandom(128), timeout=20)
        print(uid.hex())
    """
    res, _ = _launch(["--nproc", "3", "--tag-output"], snippet)
    assert res.returncode == 0, res.stderr
    by_rank = _tagged(res.stdout)
    assert sorted(by_rank) == [0, 1, 2]
    values = {lines[0] for lines in by_rank.values()}
    assert len(values) == 1 and len(values.pop()) == 256


def test_uid_file_exchange_writes_atomically(tmp_path):
    path = tmp_path / "uid.pkl"
    uid = exchange_uid_via_file(0, str(path), lambda: {"uid": b"x" * 128})
    assert pickle.loads(path.read_bytes()) == uid
    assert os.listdir(tmp_path) == ["uid.pkl"]          # no temporary file left behind
    assert exchange_uid_via_file(2, path, lambda: pytest.fail("only rank 0 makes the uid")) \
        == uid


def test_uid_file_exchange_timeout(tmp_path):
    path = tmp_path / "never-written.pkl"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="never-written.pkl"):
        exchange_uid_via_file(1, str(path), lambda: b"unused", timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_uid_file_exchange_timeout_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MOK_BOOTSTRAP_TIMEOUT", "0.1")
    with pytest.raises(TimeoutError, match="missing.pkl"):
        exchange_uid_via_file(1, str(tmp_path / "missing.pkl"), lambda: b"unused")


def test_uid_broadcast_exchange_with_stub():
    sent = {}
    made = []

    def make_uid():
        made.append(1)
        return os.urandom(128)

    def broadcast_for(rank):
        def broadcast(box):   # torch.distributed.broadcast_object_list semantics, src=0
            if rank == 0:
                sent["value"] = pickle.dumps(box[0])
            else:
                box[0] = pickle.loads(sent["value"])
        return broadcast

    got = [exchange_uid_via_broadcast(r, broadcast_for(r), make_uid) for r in range(3)]
    assert got[0] == got[1] == got[2] and len(got[0]) == 128
    assert made == [1]


def test_uid_broadcast_exchange_with_torch_gloo():
    pytest.importorskip("torch.distributed")
    snippet = """
        import os
        import torch.distributed as dist
        from mok_comm.launch.bootstrap import exchange_uid_via_broadcast
        dist.init_process_group("gloo")
        uid = exchange_uid_via_broadcast(
            dist.get_rank(), lambda box: dist.broadcast_object_list(box, src=0),
            lambda: os.urandom(128))
        print(uid.hex())
        dist.destroy_process_group()
    """
    res, _ = _launch(["--nproc", "2", "--tag-output", "--timeout", "25"], snippet)
    assert res.returncode == 0, res.stdout + res.stderr
    by_rank = _tagged(res.stdout)
    assert by_rank[0][-1] == by_rank[1][-1] and len(by_rank[0][-1]) == 256


class _StubComm:
    """mpi4py-like communicator: bcast pickles the root's object for every rank."""

    def __init__(self, rank, wire):
        self.rank, self.wire = rank, wire

    def Get_rank(self):
        return self.rank

    def bcast(self, obj, root=0):
        if self.rank == root:
            self.wire["msg"] = pickle.dumps(obj)
        return pickle.loads(self.wire["msg"])


@pytest.mark.parametrize("root", [0, 1])
def test_uid_mpi_exchange_with_stub(root):
    wire = {}
    made = []

    def make_uid():
        made.append(1)
        return os.urandom(128)

    order = [root] + [r for r in range(3) if r != root]     # the root's bcast goes first
    got = {r: exchange_uid_via_mpi(_StubComm(r, wire), make_uid, root=root) for r in order}
    assert got[0] == got[1] == got[2]
    assert made == [1]


# ------------------------------------------------------------------------------------ init()

@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(bootstrap, "_STATE", bootstrap._State())
    for var in ("NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT",
                "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "MOK_UID_FILE", "RANK", "WORLD_SIZE",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_init_without_nvshmem4py_gives_install_hint(monkeypatch, fresh_state):
    # None in sys.modules makes the import fail even where nvshmem4py is installed.
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(ImportError, match=r"nvshmem4py is not installed: pip install 'mok-py\[gpu\]'"):
        bootstrap.init()
    assert not bootstrap.is_initialized()
    assert "NVSHMEM_DISABLE_NVLS" not in os.environ        # failed before touching anything
    with pytest.raises(RuntimeError, match=r"bootstrap.init\(\) has not been called"):
        bootstrap.info()
    bootstrap.finalize()                                    # nothing to do, no error


def test_init_rejects_unknown_method(fresh_state):
    with pytest.raises(ValueError, match="method"):
        bootstrap.init("nccl")


_REAL_GPU_COUNT = bootstrap._visible_gpu_count


def _fake_nvshmem(monkeypatch):
    calls = {"get_unique_id": 0, "init": [], "finalize": 0}
    core = types.ModuleType("nvshmem.core")

    def get_unique_id():
        calls["get_unique_id"] += 1
        return b"fake-uid"

    def init(**kw):
        # NVSHMEM reads its environment here: check what it would see.
        calls["init"].append(dict(kw, env={k: os.environ.get(k) for k in (
            "NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT",
            "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")}))

    def finalize():
        calls["finalize"] += 1

    core.get_unique_id, core.init, core.finalize = get_unique_id, init, finalize
    pkg = types.ModuleType("nvshmem")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "nvshmem", pkg)
    monkeypatch.setitem(sys.modules, "nvshmem.core", core)
    monkeypatch.setattr(bootstrap, "_visible_gpu_count", lambda: 2)
    return calls


class _FakeDevice:
    def __init__(self, device_id):
        self.device_id = device_id
        self.current = False

    def set_current(self):
        self.current = True


def test_init_env_method_is_idempotent(monkeypatch, tmp_path, fresh_state):
    calls = _fake_nvshmem(monkeypatch)
    monkeypatch.setattr(bootstrap, "SOCKET_DIR", str(tmp_path))
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "eth0")   # caller's choice kept
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MOK_UID_FILE", str(tmp_path / "uid.pkl"))
    dev = _FakeDevice(1)
    with pytest.warns(RuntimeWarning, match="NVSHMEM_DISABLE_NVLS"):
        ci = bootstrap.init(device=dev)
    assert ci == CommInfo(rank=0, world_size=1, local_rank=0, device_id=1, method="env")
    assert dev.current
    assert calls["get_unique_id"] == 1
    (kw,) = calls["init"]
    assert kw["uid"] == b"fake-uid" and kw["rank"] == 0 and kw["nranks"] == 1
    assert kw["initializer_method"] == "uid" and kw["device"] is dev
    assert kw["env"] == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none",
                         "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0"}
    assert pickle.loads((tmp_path / "uid.pkl").read_bytes()) == b"fake-uid"

    assert bootstrap.init() is ci                        # same world: nothing re-done
    assert bootstrap.init(device=1) is ci
    assert len(calls["init"]) == 1 and calls["get_unique_id"] == 1
    assert bootstrap.is_initialized() and bootstrap.info() is ci

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="already initialised"):
        bootstrap.init()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="already initialised"):
        bootstrap.init(device=0)

    bootstrap.finalize()
    bootstrap.finalize()
    assert calls["finalize"] == 1
    assert not bootstrap.is_initialized()
    with pytest.raises(RuntimeError, match="finalized"):
        bootstrap.init()


def test_init_single_process_and_multi_node_defaults(monkeypatch, tmp_path, fresh_state):
    calls = _fake_nvshmem(monkeypatch)
    monkeypatch.setattr(bootstrap, "SOCKET_DIR", str(tmp_path))
    ci = bootstrap.init(device=_FakeDevice(0))
    assert ci.method == "single" and (ci.rank, ci.world_size) == (0, 1)
    assert calls["init"][0]["env"] == {"NVSHMEM_DISABLE_NVLS": "1",
                                       "NVSHMEM_REMOTE_TRANSPORT": "none",
                                       "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
    # Several nodes: NVLS still forced off, the single-node defaults are not applied.
    monkeypatch.delenv("NVSHMEM_REMOTE_TRANSPORT")
    monkeypatch.delenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
    bootstrap.apply_env_defaults(world_size=16, local_world_size=8)
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "NVSHMEM_REMOTE_TRANSPORT" not in os.environ
    assert "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in os.environ


def test_init_without_gpu_raises(monkeypatch, fresh_state):
    calls = _fake_nvshmem(monkeypatch)
    monkeypatch.setattr(bootstrap, "_visible_gpu_count", _REAL_GPU_COUNT)
    from cuda.bindings import driver as cu
    # As the driver answers on a machine without GPUs (also checked here when one has them).
    monkeypatch.setattr(cu, "cuInit", lambda flags: (cu.CUresult.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        bootstrap.init()
    assert calls["init"] == [] and calls["get_unique_id"] == 0
    assert not bootstrap.is_initialized()


def test_auto_refuses_to_split_a_multi_rank_launch(monkeypatch, fresh_state):
    _fake_nvshmem(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4"):
        bootstrap.init(device=_FakeDevice(0))


# ------------------------------------------------------------------------------ stale sockets

def test_clean_stale_sockets_removes_only_dead_owners():
    me, dead = os.getpid(), _dead_pid()
    # AF_UNIX paths are limited to ~108 bytes: use a short directory, not pytest's tmp_path.
    d = tempfile.mkdtemp(prefix="mok-sock-")
    try:
        def sock(name):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(os.path.join(d, name))
            s.close()                      # the file stays, as after a crash

        stale = [f"nvshmem-socket-{dead}-{dead}",      # own socket of a dead PE
                 f"nvshmem-socket-{me}-{dead}",        # dead PE's receive socket from us
                 f"nvshmem-socket-{dead}"]             # pre-3.x single-pid name
        live = [f"nvshmem-socket-{me}-{me}",
                f"nvshmem-socket-{dead}-{me}"]         # we bound it: ours, whoever sends
        for name in stale + live:
            sock(name)
        # Not sockets or not NVSHMEM's: never touched, dead pid or not.
        open(os.path.join(d, f"nvshmem-socket-{dead}-9{dead}"), "w").close()
        open(os.path.join(d, f"other-socket-{dead}"), "w").close()
        sock(f"nvshmem-socket-{dead}-{dead}.bak")

        removed = clean_stale_sockets(d)
        assert sorted(os.path.basename(p) for p in removed) == sorted(stale)
        assert sorted(os.listdir(d)) == sorted(live + [f"nvshmem-socket-{dead}-9{dead}",
                                                       f"other-socket-{dead}",
                                                       f"nvshmem-socket-{dead}-{dead}.bak"])
        assert clean_stale_sockets(d) == []
        assert clean_stale_sockets(os.path.join(d, "missing")) == []
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
