"""Data-parallel training on torch.distributed: the world of one `tierflow run` process, its process
groups, the collectives the executor needs outside the plan's ops, and the `--nproc` launch through torchrun.

A plan made for W = gpus x nodes ranks runs as W processes started by torchrun (`torchrun --nproc-per-node N
-m tierflow run plan.json ...`, or `tierflow run plan.json --nproc N`, which runs torch.distributed.run
itself). Each process reads its rank from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and:

- computes on one device: cuda:LOCAL_RANK (NCCL) or the CPU (gloo);
- owns a 1/W shard of every block's flat vector, elements [r*ceil(n/W), min(n, (r+1)*ceil(n/W))) (ZeRO-3
  partitioning, tierflow.planner.core.world): its compute weights, fp32 master, Adam moments and gradient
  accumulators of that shard live on its tiers as the plan's placement splits them (tiers/state.py);
- trains on sequences [r*B/W, (r+1)*B/W) of each global batch of B sequences (engine.py), scales its loss by
  1/W so that the summed gradient shard equals one rank's gradient of the whole batch, and reports the mean
  loss over the ranks;
- replays the same op list as every other rank; the plan's ops on resource `net` (all_gather_weights,
  reduce_scatter_grads: ops/net.py) run on a worker of their own, in the plan's order, on the *net* process
  group. Everything else collective (the loss, checkpoint agreement, gathering the final weights) runs on a
  separate gloo group (*ctrl*) from the main or the reporter thread, never concurrently with itself, so the
  two groups' collectives never interleave differently on different ranks.

One process (no torchrun) on a 1-rank plan is `SINGLE`: no process group, nothing changes.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tierflow.errors import TierflowError
from tierflow.planner.core.world import shard_range


class LaunchError(TierflowError, ValueError):
    """A run launched with another number of processes than its plan's ranks,
    or a bad launch flag (exit 2)."""

    agreed = True  # every rank finds the same: rank 0 says it


class RankLost(TierflowError):
    """Another rank of the run died or left it: this rank stops too (exit code 5, one line naming it, said as
    `tierflow run [rank R]: ...`)."""

    exit_code = 5
    prefix = ""  # the message says it

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank  # the rank that stops (named in its line)


@dataclass
class DistWorld:
    """The data-parallel world as this process sees it."""

    rank: int = 0
    ranks: int = 1
    local_rank: int = 0
    local_ranks: int = 1
    net_group: Any = None  # the plan's collectives (NCCL on CUDA, gloo on CPU)
    ctrl_group: Any = None  # losses, checkpoint agreement, final weights (gloo, CPU tensors)
    backend: str = "none"
    peers: list = field(default_factory=list)  # (host name, pid) of every rank, in rank order

    @property
    def single(self) -> bool:
        return self.ranks == 1

    def shard(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank's shard of an n-element flat vector."""
        return shard_range(n, self.ranks, self.rank) if not self.single else (0, n)

    def shard_size(self, n: int) -> int:
        """Elements of every rank's slot in a gathered vector: ceil(n / W) (the last shard may be shorter)."""
        return -(-n // self.ranks)

    def padded(self, n: int) -> int:
        return self.shard_size(n) * self.ranks

    # -- collectives on the ctrl group (CPU), from one thread at a time -------------------------------------

    def mean(self, value: float) -> float:
        """The mean of `value` over the ranks (the reported loss)."""
        if self.single:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.ctrl_group)
        return float(t[0]) / self.ranks

    def barrier(self) -> None:
        if not self.single:
            dist.barrier(group=self.ctrl_group)

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.single:
            return [obj]
        out: list[object] = [None] * self.ranks
        dist.all_gather_object(out, obj, group=self.ctrl_group)
        return out

    def broadcast(self, obj: object, src: int = 0) -> object:
        if self.single:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.ctrl_group)
        return box[0]

    def gather_vector(self, shard: torch.Tensor, n: int) -> torch.Tensor:
        """The full n-element vector (CPU) from every rank's shard of it."""
        if self.single:
            return shard
        s = self.shard_size(n)
        slot = torch.zeros(s, dtype=shard.dtype)
        slot[: shard.numel()].copy_(shard)
        out = torch.empty(s * self.ranks, dtype=shard.dtype)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(out, slot, group=self.ctrl_group)
        return out[:n]


SINGLE = DistWorld()
_WORLD: DistWorld | None = None  # the process's world once its groups exist (they are made once per process)


def launched_ranks() -> int:
    """WORLD_SIZE as torchrun sets it (1 when this process was not started by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_launch(plan_ranks: int, gpus: int, nodes: int, plan_source: str) -> None:
    """LaunchError unless this process was started as one of exactly the plan's ranks."""
    have = launched_ranks()
    if have == plan_ranks:
        return
    how = (f"tierflow run {plan_source} --nproc {gpus}"
           + (f" --nnodes {nodes} --rdzv-endpoint HOST:PORT" if nodes > 1 else "")
           + f", or torchrun --nnodes {nodes} --nproc-per-node {gpus} -m tierflow run {plan_source} ...")
    if plan_ranks == 1:
        raise LaunchError(f"launched as {have} ranks, but plan {plan_source} is for one GPU (run it without "
                          "torchrun, or plan again with --gpus/--nodes)")
    raise LaunchError(f"plan {plan_source} is for {plan_ranks} ranks ({gpus} GPU(s) x {nodes} box(es)), but "
                      f"this run has {have}: launch it with {how}")


def rank_device(device: str, world_ranks: int) -> str:
    """The --device of this rank: cuda:LOCAL_RANK for cuda;
    an explicit cuda:N is refused with several ranks."""
    if world_ranks == 1:
        return device
    local = os.environ.get("LOCAL_RANK", "0")
    if device == "cuda":
        return f"cuda:{local}"
    if device.startswith("cuda:"):
        raise LaunchError(f"--device {device}: with several ranks each rank computes on cuda:LOCAL_RANK; "
                          "pass --device cuda")
    if device == "cpu-adversarial":  # the emulation of a CUDA device: one emulated device index per rank
        return f"cpu-adversarial:{local}"
    return device


def init_world(plan_ranks: int, device: torch.device) -> DistWorld:
    """The world of this process: SINGLE for a 1-rank plan, else the default process group (NCCL on CUDA,
    gloo on CPU) for the plan's collectives and a gloo group for the rest. Made once per process (a test may
    run several plans in one process group)."""
    global _WORLD
    if plan_ranks == 1:
        return SINGLE
    if _WORLD is not None:
        return _WORLD
    watch_launcher()  # before the rendezvous, which waits for every rank
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kw: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=30)}
        if device.type == "cuda":
            kw["device_id"] = device
        dist.init_process_group(**kw)
    ctrl = dist.new_group(backend="gloo")
    _WORLD = DistWorld(rank=dist.get_rank(), ranks=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       net_group=None, ctrl_group=ctrl, backend=backend)
    _WORLD.peers = _WORLD.gather_objects((socket.gethostname(), os.getpid()))
    return _WORLD


def _process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie that its launcher has not reaped yet counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # bytes: no codec to look up (a rank stopping on SIGTERM once failed to find "ascii": LookupError)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


EXIT_KEY = "tierflow/exit/{rank}"  # in the launch's store: set by a rank that stops on an error of its own


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (not launched by torchrun, or torn down): nothing recorded
        return None


def note_exit(code: int) -> None:
    """Record in the launch's store that this rank stops on its own error (exit `code`), so that the ranks
    left do not take its end for a death (lost_ranks)."""
    store = _store()
    if store is not None and _WORLD is not None:
        try:
            store.set(EXIT_KEY.format(rank=_WORLD.rank), str(code))
        except Exception:  # noqa: BLE001 - the store's server (rank 0's launcher) may be gone
            pass


def _noted_exit(rank: int) -> bool:
    store = _store()
    try:
        return store is not None and store.check([EXIT_KEY.format(rank=rank)])
    except Exception:  # noqa: BLE001
        return False


def peer_gone() -> bool:
    """Whether another rank of this host has ended, from /proc alone (no store: a signal handler calls it, and
    the store's client may be held by a thread blocked in a collective), or this rank's launcher."""
    if launcher_gone():
        return True
    world = _WORLD
    if world is None or world.single or not world.peers:
        return False
    host = socket.gethostname()
    return any(r != world.rank and h == host and _process_gone(pid) for r, (h, pid) in enumerate(world.peers))


def lost_ranks() -> list[tuple[int, int]]:
    """(rank, pid) of every other rank of this process's world that ran on this host and has died (ended
    without noting an error of its own, note_exit); empty with one rank, or when every rank of this host is
    alive (a rank on another box cannot be checked)."""
    world = _WORLD
    if world is None or world.single or not world.peers:
        return []
    host = socket.gethostname()
    return [(r, pid) for r, (h, pid) in enumerate(world.peers)
            if r != world.rank and h == host and _process_gone(pid) and not _noted_exit(r)]


# the final barrier waits for rank 0 to finish --out (a Gantt chart of a long trace takes a while); the
# process groups' teardown is local work
FINAL_BARRIER_S = 120.0
TEARDOWN_S = 30.0


def leave_cleanly(barrier_s: float = FINAL_BARRIER_S, teardown_s: float = TEARDOWN_S) -> str | None:
    """The end of a rank that trained to the end: a barrier on the ctrl group bounded by `barrier_s` (every
    rank is past its last collective before any tears its connections down), then destroy_process_group on a
    daemon thread, waited for at most `teardown_s`. None when both finished, else what did not (the caller
    exits anyway: a rank whose work is done must not hang on a peer or a teardown)."""
    problem = None
    world = _WORLD
    if world is not None and world.ctrl_group is not None and not world.single:
        try:
            dist.monitored_barrier(group=world.ctrl_group, timeout=datetime.timedelta(seconds=barrier_s),
                                   wait_all_ranks=True)
        except RuntimeError as e:  # a rank that did not arrive in time, or is gone
            problem = f"the final barrier failed ({' '.join(str(e).split())[:120]})"
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: there is nothing left to tear down with it
            pass
        finally:
            done.set()

    threading.Thread(target=destroy, name="tierflow-leave", daemon=True).start()
    if not done.wait(teardown_s):
        problem = problem or f"leaving the process group did not finish in {teardown_s:g} s"
    return problem


def current_world() -> DistWorld | None:
    """This process's world of several ranks, None before it is made (or with one rank)."""
    return _WORLD


# -- a rank dies with its launcher ---------------------------------------------------------------------------
# torchrun starts every rank in a session of its own (start_new_session): a launcher killed with SIGKILL
# passes nothing on, and its ranks, now children of init, would train on. Each rank therefore watches its
# launcher: Linux delivers SIGTERM at the launcher's death (prctl PR_SET_PDEATHSIG), and a thread polls the
# parent pid (every system), sends the SIGTERM itself where the kernel did not, and ends the process if it
# has not stopped LAUNCHER_GRACE_S later. SIGTERM stops the rank as a stop signal does (signals.py), at once
# (peer_gone is true): the round under way is abandoned, a half-written checkpoint removed, the last
# complete one kept.

LAUNCHER_PID_ENV = "TIERFLOW_LAUNCHER_PID"  # set by `--nproc` (launch): the process that started the ranks
LAUNCHER_POLL_S = 0.25
LAUNCHER_GRACE_S = 15.0  # after the SIGTERM: the rank's own stop (workers joined, SSD files removed) ends it
PR_SET_PDEATHSIG = 1
# "pid": the launcher watched; "gone": threading.Event, set once it died; "alive": whether it lives now
_LAUNCHER: dict[str, Any] = {}


def _parent_death_signal(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def launcher_pid() -> int:
    """The pid of the process that started this rank: --nproc's launcher (its environment says), else the
    parent at the time of the first call (torchrun started by the user)."""
    try:
        return int(os.environ[LAUNCHER_PID_ENV])
    except (KeyError, ValueError):
        return os.getppid()


def launcher_gone() -> bool:
    """Whether the launcher of this rank has died (watch_launcher noticed it)."""
    gone, alive = _LAUNCHER.get("gone"), _LAUNCHER.get("alive")
    return gone is not None and (gone.is_set() or not alive())


def watch_launcher(poll_s: float = LAUNCHER_POLL_S, grace_s: float = LAUNCHER_GRACE_S) -> None:
    """Make this rank (launched by torchrun, several ranks) die with its launcher: SIGTERM when it dies, and
    the end of the process `grace_s` after. Once per process; nothing for a process not launched as a rank."""
    if _LAUNCHER or launched_ranks() <= 1:
        return
    pid = launcher_pid()
    gone = threading.Event()
    _LAUNCHER.update(pid=pid, gone=gone)
    by_kernel = _parent_death_signal(signal.SIGTERM)
    parent = os.getppid() == pid  # else a wrapper between (or the launcher died already): watch the pid

    def alive() -> bool:  # a dead parent's children are re-parented (to init or a subreaper)
        return os.getppid() == pid if parent else not _process_gone(pid)

    _LAUNCHER["alive"] = alive

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        gone.set()  # the rank's stop says why (launch.rank_lost)
        if not (by_kernel and parent):  # no signal from the kernel, or the launcher died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        print(f"tierflow run [rank {os.environ.get('RANK', '?')}]: its launcher (pid {pid}) died and it did "
              f"not stop within {grace_s:g} s; ending it", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="tierflow-launcher-watch", daemon=True).start()


# -- `tierflow run --nproc N`: torchrun, started from here ---------------------------------------------------

LAUNCH_FLAGS = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id")


def strip_launch_flags(argv: list[str]) -> list[str]:
    """argv without the launch flags (and their values), i.e. what every rank runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def torchrun_args(nproc: int, nnodes: int, rdzv_endpoint: str | None, rdzv_id: str,
                  argv: list[str]) -> list[str]:
    """torch.distributed.run's arguments that start `nproc` ranks here of `nnodes` boxes running `argv`."""
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError(f"--nnodes {nnodes}: pass --rdzv-endpoint HOST:PORT, the address every box's "
                          "launcher meets at (e.g. the first box's address and a free port)")
    if nnodes == 1 and not rdzv_endpoint:
        where = ["--standalone"]
    else:
        where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *where, "--max-restarts", "0",
            "--module", "tierflow", *argv]


@contextmanager
def _ranks_env() -> Iterator[None]:
    """The environment the ranks inherit while torchrun starts them, this process's own restored after: the
    launcher's pid (the ranks watch it: watch_launcher), and c10d's C++ log at errors only, so that a rank
    stopping because a peer or the launcher died says so in one line, without a warning and a C++ stack per
    broken socket (TORCH_CPP_LOG_LEVEL=WARNING shows them again)."""
    old = {k: os.environ.get(k) for k in (LAUNCHER_PID_ENV, "TORCH_CPP_LOG_LEVEL")}
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(nproc: int, nnodes: int, rdzv_endpoint: str | None, rdzv_id: str, argv: list[str]) -> int:
    """Run torch.distributed.run in this process; the exit code is that of the first rank that failed (so that
    bad input is 2, a diverged run 4, ...), 0 when all succeeded."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    env_threads = "OMP_NUM_THREADS" not in os.environ
    if env_threads:  # torchrun would set 1 and say so; give each local rank its share of the cores instead
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the failing rank says why
    args = parse_args(torchrun_args(nproc, nnodes, rdzv_endpoint, rdzv_id, argv))
    try:
        with _ranks_env():
            run(args)
    except ChildFailedError as e:
        # the root cause: a rank killed by a signal (the others stop because of it, exit 5), else the first
        killed = [f for f in e.failures.values() if f.exitcode < 0]
        code = (killed[0] if killed else e.get_first_failure()[1]).exitcode
        return 128 - code if code < 0 else code  # a rank killed by signal S: 128 + S, as a shell reports it
    except SignalException as e:  # SIGINT / SIGTERM: torchrun passed it on to the ranks, which stop cleanly
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the launcher's own failure (rendezvous timeout, port in use, ...)
        print(f"tierflow run: the torchrun launch failed: {type(e).__name__}: "
              f"{' '.join(str(e).split())[:200]}",
              file=sys.stderr)
        return 1
    return 0
