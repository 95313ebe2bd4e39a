"""Multi-process JAX (multi-controller SPMD, DESIGN.md "Distributed").

Every process runs the same program; `jax.distributed.initialize` joins them
into one runtime whose `jax.devices()` lists every process's devices, so a
`Mesh` over them spans hosts and jitted steps run over the global mesh.

    ulorl train --config FILE --run-dir DIR --coordinator HOST:PORT --num-processes P --process-id I

- `add_arguments(parser)` / `initialize_from_args(args)`: the three flags and
  the call `ulorl train` makes before it builds anything that touches jax.
  On CPU, cross-process collectives need gloo, selected before initialising.
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
import json
import logging
from typing import Any, Sequence

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("multi-process (jax.distributed; omit all three for one process)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service, e.g. 10.0.0.1:1234")
    g.add_argument("--num-processes", type=int, default=None, metavar="P", help="total processes (hosts)")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index in [0, P)")
    g.add_argument("--init-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for every process to join (default 300)")
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


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
               timeout_s: int = 300) -> bool:
    """Join the multi-process runtime (a no-op when no flag is given). Call before any jax computation."""
    if not check_arguments(coordinator, num_processes, process_id):
        return False
    import jax

    platforms = str(jax.config.jax_platforms or "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        # CPU collectives across processes (the default implementation is single-process only).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    open_collectives()
    return True


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
                      getattr(args, "process_id", None), timeout_s=getattr(args, "init_timeout", 300))


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
