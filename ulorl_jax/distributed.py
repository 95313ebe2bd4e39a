"""Multi-process JAX (multi-controller SPMD, DESIGN.md "Distributed").

Every process runs the same program; `jax.distributed.initialize` joins them
into one runtime whose `jax.devices()` lists every process's devices, so a
`Mesh` over them spans hosts and jitted steps run over the global mesh.

    ulorl train --config FILE --run-dir DIR [--distributed auto|on|off]
                [--coordinator HOST:PORT --num-processes P --process-id I] [--init-timeout S]

How a process decides (`plan_launch`):
- the three flags given: join process 0's coordinator at HOST:PORT as process I of P (jax's cluster
  detection off, so nothing in the environment changes them or the visible devices);
- no flags, `--distributed auto` (default): join when `detect_cluster(os.environ)` names a multi-process
  launch jax can bootstrap from its environment alone, and let jax fill in the address, count and id:
  `slurm` (an `srun` job step with SLURM_NTASKS > 1), `ompi` (Open MPI 4 `mpirun` with more than one
  rank), `gketpu` (a GKE TPU slice of more than one host, or several slices). Anything else, including
  one SLURM task, a plain machine and a Cloud TPU VM (its pod membership is in the metadata server, not
  the environment), runs one process with no `jax.distributed` at all;
- `--distributed on`: always join; with no flags jax's own detection runs over every cluster it knows
  (Cloud TPU VM metadata and Kubernetes included), and an error names what to give when it finds none;
- `--distributed off`: one process, even inside a multi-task SLURM step.
The join has `--init-timeout` seconds. jax 0.10 does not raise when the coordinator is unreachable or
a process never joins: XLA aborts the process (SIGABRT) with a C++ stack trace. So a watchdog thread
reports it first, as one paragraph (the address, the timeout, process I of P, what a TCP connection to
the address finds, what to check), and exits with status 2; jax is given `--init-timeout` + 30 s.

- `shard_prompts` / `allgather_json`: the helpers `rollout.distributed.DistributedRollout`
  builds on; each process decodes its contiguous share of the step's new prompts with its own engine
  (on its local devices: `decode/placement.py`) and keeps its own
  unfinished pool; the samples that ended are gathered so every process feeds
  the learner the same global batch (the learner step runs over the global
  mesh). Sample uids are assigned globally (as one process would), so a
  sample's tokens do not depend on how many processes there are.
- Checkpoints: every process calls the save (orbax's is a collective); host
  state that differs per process (the unfinished pools) is gathered with
  `allgather_json` and saved as a list indexed by process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
GRACE_S = 30  # jax's own join deadline is this much later than the watchdog's, so the watchdog reports first
WATCHDOG_EXIT = 2  # as the CLI's other errors
# jax's per-process device restriction under SLURM / Open MPI (one GPU each, by local rank) is undone for
# one process per host, where it would hide all but one GPU.
VISIBLE_DEVICE_FLAGS = ("jax_cuda_visible_devices", "jax_rocm_visible_devices")

DISTRIBUTED_HELP = (
    "auto (default): with none of --coordinator/--num-processes/--process-id, join the other processes when "
    "this is a multi-process launch jax bootstraps by itself: a SLURM job step with SLURM_NTASKS > 1 (srun, "
    "one task per host), Open MPI 4 mpirun with more than one rank, a GKE TPU slice of several hosts; "
    "otherwise (one SLURM task, a plain machine) run one process. on: always call jax.distributed.initialize; "
    "without the three flags jax finds the cluster itself, Cloud TPU VM pods included (gcloud ... "
    "--worker=all: their layout is in the TPU metadata, not the environment, so auto does not see it); an "
    "error if it finds none. off: one process, even inside a multi-task SLURM step.")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("multi-process (jax.distributed): under SLURM srun, Open MPI or a GKE TPU slice "
                                  "no flag is needed; omit them all on one machine")
    g.add_argument("--distributed", choices=MODES, default="auto", help=DISTRIBUTED_HELP)
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service, e.g. 10.0.0.1:1234 (with the next two: "
                        "overrides any detected cluster)")
    g.add_argument("--num-processes", type=int, default=None, metavar="P", help="total processes (hosts)")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index in [0, P)")
    g.add_argument("--init-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for every process to join (default 300); then the process exits with "
                        "an error naming the coordinator address")
    return parser


def check_arguments(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Validate the three flags; True when multi-process is requested."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()):
        return False
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"multi-process training needs --coordinator, --num-processes and --process-id together; "
                         f"missing {missing}")
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator={coordinator!r}: expected HOST:PORT, e.g. 127.0.0.1:1234")
    if num_processes < 1:
        raise ValueError(f"--num-processes={num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id={process_id} must be in [0, --num-processes={num_processes})")
    return True


# ---------------------------------------------------------------------------
# Launch: which processes join, and how
# ---------------------------------------------------------------------------


def _int(environ: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def detect_cluster(environ: Mapping[str, str]) -> str | None:
    """The multi-process launch `environ` shows, as jax's `cluster_detection_method` name, or None.

    The variables are those jax's own detection reads (jax/_src/clusters, checked in the same order), plus
    a process count above 1: a single task is not a multi-process run. `ompi` needs Open MPI 4's
    OMPI_MCA_orte_hnp_uri (Open MPI 5 no longer sets it: give the three flags there)."""
    if "OMPI_MCA_orte_hnp_uri" in environ and _int(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in environ for k in slurm) and _int(environ, "SLURM_NTASKS") > 1:
        return "slurm"  # SLURM_STEP_NODELIST: set by `srun` for the tasks it starts
    hosts = environ.get("TPU_PROCESS_ADDRESSES", environ.get("TPU_WORKER_HOSTNAMES"))
    if hosts and len(hosts.split(",")) * max(1, _int(environ, "MEGASCALE_NUM_SLICES", 1)) > 1:
        return "gketpu"
    return None


def one_process_per_host(cluster: str | None, environ: Mapping[str, str]) -> bool:
    """True when the detected SLURM / Open MPI launch runs one process on each host (every host of a job
    step runs at least one task, so as many tasks as hosts means exactly one each)."""
    if cluster == "slurm":
        return environ.get("SLURM_NTASKS") == environ.get("SLURM_STEP_NUM_NODES")
    return cluster == "ompi" and environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"


@dataclasses.dataclass(frozen=True)
class Launch:
    """The arguments for `jax.distributed.initialize`: the three flags, or none and the cluster to read."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cluster: str | None = None  # jax's cluster_detection_method; None with no flags: jax tries them all
    keep_local_devices: bool = False  # undo jax's one-GPU-per-process default (one process per host)

    def initialize_kwargs(self) -> dict[str, Any]:
        if self.coordinator is not None:
            return {"coordinator_address": self.coordinator, "num_processes": self.num_processes,
                    "process_id": self.process_id, "cluster_detection_method": "deactivate"}
        return {} if self.cluster is None else {"cluster_detection_method": self.cluster}

    def describe(self) -> str:
        if self.coordinator is not None:
            return f"--coordinator {self.coordinator} --num-processes {self.num_processes} " \
                   f"--process-id {self.process_id}"
        return f"the {self.cluster} environment" if self.cluster else "jax's cluster detection (--distributed on)"


def plan_launch(mode: str, coordinator: str | None = None, num_processes: int | None = None,
                process_id: int | None = None, environ: Mapping[str, str] | None = None) -> Launch | None:
    """How this process joins (None: it runs alone). `mode` is --distributed; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"--distributed={mode!r}: expected one of {', '.join(MODES)}")
    explicit = check_arguments(coordinator, num_processes, process_id)
    if mode == "off":
        if explicit:
            raise ValueError("--distributed off runs one process: drop --coordinator, --num-processes and "
                             "--process-id, or use --distributed auto (the default) or on")
        return None
    if explicit:
        return Launch(coordinator, num_processes, process_id)
    environ = os.environ if environ is None else environ
    cluster = detect_cluster(environ)
    if cluster is None and mode == "auto":
        return None
    return Launch(cluster=cluster, keep_local_devices=one_process_per_host(cluster, environ))


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               timeout_s: int = 300, mode: str = "auto", environ: Mapping[str, str] | None = None) -> bool:
    """Join the multi-process runtime when `plan_launch` says so (False: one process, nothing done).
    Call before any jax computation."""
    if timeout_s < 1:
        raise ValueError(f"--init-timeout={timeout_s} must be >= 1 (seconds)")
    launch = plan_launch(mode, coordinator, num_processes, process_id, environ)
    if launch is None:
        return False
    import jax

    platforms = str(jax.config.jax_platforms or "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        # CPU collectives across processes (the default implementation is single-process only).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    join(launch, timeout_s)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    open_collectives()
    return True


def join(launch: Launch, timeout_s: int) -> None:
    """`jax.distributed.initialize` under a watchdog that reports a join not done in `timeout_s`."""
    import jax

    visible = {k: jax.config.read(k) for k in VISIBLE_DEVICE_FLAGS} if launch.keep_local_devices else {}
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            print(f"ulorl train: error: {join_timeout_message(launch, timeout_s)}", file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT)  # the main thread is inside XLA's connect, which no exception interrupts

    threading.Thread(target=watchdog, name="jax.distributed join watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(**launch.initialize_kwargs(), initialization_timeout=timeout_s + GRACE_S)
    except (ValueError, RuntimeError) as err:  # e.g. `on` with no cluster: "coordinator_address should be defined."
        hint = "" if launch.coordinator or "coordinator_address" not in str(err) else (
            "; jax found no cluster it can read (an srun step, Open MPI 4 mpirun, a Cloud TPU VM or GKE TPU "
            "slice, Kubernetes with jax[k8s]): give --coordinator, --num-processes and --process-id")
        raise ValueError(f"jax.distributed.initialize from {launch.describe()} failed: "
                         f"{str(err).rstrip('.')}{hint}") from err
    finally:
        done.set()
    for flag, value in visible.items():
        jax.config.update(flag, value)


def joining(launch: Launch) -> tuple[str | None, int | None, int | None]:
    """(coordinator address, process id, process count) of the join in progress: the flags', or what jax
    read from the cluster. jax keeps those in its private state (set before it connects) and has no public
    accessor; read only for the error message, with the flags as the fallback."""
    state = getattr(sys.modules.get("jax._src.distributed"), "global_state", None)
    return (getattr(state, "coordinator_address", None) or launch.coordinator,
            getattr(state, "process_id", None) if launch.process_id is None else launch.process_id,
            getattr(state, "num_processes", None) if launch.num_processes is None else launch.num_processes)


def probe(address: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(whether something listens at HOST:PORT, what a TCP connection finds, in words)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True, f"{address} accepts connections, so process 0's coordination service is running"
    except socket.gaierror:
        return False, f"the host name {host!r} does not resolve here"
    except ConnectionRefusedError:
        return False, f"{host} refuses connections on port {port}: nothing listens there"
    except OSError as err:
        return False, (f"no answer from {address} within {timeout_s:g} s ({err.__class__.__name__}): a "
                       f"firewall, or the wrong address")


def join_timeout_message(launch: Launch, timeout_s: int) -> str:
    """One paragraph: what did not join in `timeout_s`, what a connection to the coordinator finds now, what
    to check."""
    address, process_id, count = joining(launch)
    who = f"process {'?' if process_id is None else process_id} of {'?' if count is None else count}"
    origin = "" if launch.coordinator else f" (from {launch.describe()}; JAX_COORDINATOR_PORT sets its port)"
    if address is None:
        return f"{who}: {launch.describe()} gave no coordinator address within --init-timeout {timeout_s} s"
    listening, finding = probe(address)
    if listening:
        what = "not every process joined"
        check = ("every process was started, each with the same process count and its own process id "
                 "(a count that differs, or two processes with one id, never completes)")
    else:
        what = "could not reach"
        check = (f"process 0 was started and runs on that host, the address is process 0's as this host reaches "
                 f"it, and no firewall blocks TCP port {address.rpartition(':')[2]} between the hosts")
    return (f"{who}: {what} the coordinator at {address}{origin} within --init-timeout {timeout_s} s: "
            f"{finding}. Check that {check}; if the hosts start minutes apart, raise --init-timeout.")


def open_collectives() -> None:
    """Set up now, while the processes are in step, the communicators the trainer uses (one device per
    process: `allgather_json`; every device: the learner and the decode placement on a 1-axis mesh).

    On CPU, gloo gives every process 30 s (not configurable) to join a communicator the first time it
    is used, so a process that reaches its first gather after its peers finish compiling or scoring
    would abort the run; a communicator already set up waits as long as it takes. Meshes whose
    collectives run over device subsets (e.g. data x fsdp) still set those up at their first step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    allgather_json(None)
    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    ones = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, PartitionSpec("all")),
                                        lambda index: np.ones((1,), np.float32))
    jax.block_until_ready(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones))


def initialize_from_args(args: argparse.Namespace) -> bool:
    return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None), timeout_s=getattr(args, "init_timeout", 300),
                      mode=getattr(args, "distributed", "auto"))


# ---------------------------------------------------------------------------
# Rollout across processes
# ---------------------------------------------------------------------------


def shard_bounds(total: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[start, stop) of this process's contiguous share (the first `total % P` shares get one more)."""
    base, extra = divmod(total, process_count)
    start = process_index * base + min(process_index, extra)
    return start, start + base + (process_index < extra)


def shard_prompts(prompts: Sequence[Any], process_index: int | None = None, process_count: int | None = None
                  ) -> tuple[int, list]:
    """(start index, this process's contiguous share of `prompts`)."""
    import jax

    i = jax.process_index() if process_index is None else process_index
    p = jax.process_count() if process_count is None else process_count
    start, stop = shard_bounds(len(prompts), i, p)
    return start, list(prompts[start:stop])


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-able `obj`, in process order (a byte all-gather over the global devices)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))  # [P, 1]
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[:data.size] = data
    gathered = multihost_utils.process_allgather(padded)  # [P, max]
    return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(gathered, sizes[:, 0])]
