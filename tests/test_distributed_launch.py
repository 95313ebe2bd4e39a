"""How `ulorl train` decides to join a multi-process run (`ulorl_jax.distributed`: `detect_cluster`,
`plan_launch`, `--distributed`) and how it reports a coordinator it cannot reach.

Cluster detection reads fake environments; the auto launch calls a stand-in for `jax.distributed.initialize`
(nothing joins). Two real runs: `ulorl train` as process 1 of 2 pointed at a port where nothing listens, with
a 2 s --init-timeout (about 4 s in all), and 2 processes that join with no flag under a fake `srun` step
(about 8 s).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ulorl_jax import distributed
from ulorl_jax.distributed import (
    Launch,
    detect_cluster,
    join_timeout_message,
    one_process_per_host,
    plan_launch,
)

# What `srun --nodes 2 --ntasks-per-node 1` sets (the variables jax's SLURM detection reads, plus the node count).
SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2",
              "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}
# `mpirun -np 2` of Open MPI 4 (one rank per host).
OMPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"HOME": "/root", "PATH": "/usr/bin"}, None),
    (SLURM_STEP, "slurm"),
    ({**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_NODES": "1"}, None),  # one task: one process
    ({k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_NODELIST"}, None),  # not a step: jax needs it
    (OMPI, "ompi"),
    ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}, None),  # Open MPI 5: jax cannot read it
    ({**SLURM_STEP, **OMPI}, "ompi"),  # mpirun inside an allocation: jax checks Open MPI first
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3", "TPU_WORKER_ID": "2"}, "gketpu"),
    ({"TPU_WORKER_HOSTNAMES": "t-0", "TPU_WORKER_ID": "0"}, None),  # a single-host slice
    ({"TPU_WORKER_HOSTNAMES": "t-0", "MEGASCALE_NUM_SLICES": "2"}, "gketpu"),  # one host per slice, 2 slices
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "x", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, None),  # a value that is no number counts as one task
], ids=["empty", "plain", "slurm-2-tasks", "slurm-1-task", "slurm-no-step", "ompi-2", "ompi-1", "ompi5",
        "ompi-in-slurm", "gke-4-hosts", "gke-1-host", "gke-multislice", "slurm-garbage"])
def test_detect_cluster(environ, expected):
    assert detect_cluster(environ) == expected


def test_one_process_per_host():
    assert one_process_per_host("slurm", SLURM_STEP)
    assert not one_process_per_host("slurm", {**SLURM_STEP, "SLURM_NTASKS": "16"})  # 8 tasks (GPUs) per node
    assert one_process_per_host("ompi", OMPI)
    assert not one_process_per_host("ompi", {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    assert not one_process_per_host("gketpu", {"TPU_WORKER_HOSTNAMES": "a,b"})  # jax never narrows TPUs
    assert not one_process_per_host(None, {})


FLAGS = ("10.0.0.1:1234", 2, 1)


def test_plan_launch_flag_combinations():
    # No flags: a detected cluster joins in auto and on; nothing detected is one process in auto.
    assert plan_launch("auto", environ={}) is None
    assert plan_launch("auto", environ={**SLURM_STEP, "SLURM_NTASKS": "1"}) is None
    assert plan_launch("auto", environ=SLURM_STEP) == Launch(cluster="slurm", keep_local_devices=True)
    assert plan_launch("on", environ=OMPI) == Launch(cluster="ompi", keep_local_devices=True)
    assert plan_launch("on", environ={}) == Launch()  # jax's own detection over everything it knows
    assert plan_launch("off", environ=SLURM_STEP) is None
    # The three flags: an explicit launch in auto and on, whatever the environment.
    assert plan_launch("auto", *FLAGS, environ=SLURM_STEP) == Launch(*FLAGS)
    assert plan_launch("on", *FLAGS, environ={}) == Launch(*FLAGS)
    with pytest.raises(ValueError, match="--distributed off runs one process"):
        plan_launch("off", *FLAGS, environ={})
    with pytest.raises(ValueError, match="missing"):
        plan_launch("auto", "10.0.0.1:1234", None, 0, environ=SLURM_STEP)
    with pytest.raises(ValueError, match="expected one of auto, on, off"):
        plan_launch("yes", environ={})


def test_initialize_kwargs():
    assert Launch(*FLAGS).initialize_kwargs() == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2,
                                                  "process_id": 1, "cluster_detection_method": "deactivate"}
    assert Launch(cluster="slurm").initialize_kwargs() == {"cluster_detection_method": "slurm"}
    assert Launch().initialize_kwargs() == {}


@pytest.fixture
def fake_jax_initialize(monkeypatch):
    """Record `jax.distributed.initialize`'s calls instead of joining; it narrows the visible GPUs as jax does
    under SLURM. Config values the launch changes are restored afterwards."""
    import jax

    calls = []

    def initialize(**kwargs):
        calls.append(kwargs)
        jax.config.update("jax_cuda_visible_devices", "0")

    saved = {k: jax.config.read(k) for k in distributed.VISIBLE_DEVICE_FLAGS}
    saved["jax_cpu_collectives_implementation"] = jax.config.jax_cpu_collectives_implementation
    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(distributed, "open_collectives", lambda: None)
    yield calls
    for k, v in saved.items():
        jax.config.update(k, v)


def test_auto_with_a_detected_cluster_lets_jax_fill_in_the_address(fake_jax_initialize):
    import jax

    assert distributed.initialize(timeout_s=60, environ=SLURM_STEP) is True
    assert fake_jax_initialize == [{"cluster_detection_method": "slurm",
                                    "initialization_timeout": 60 + distributed.GRACE_S}]
    assert jax.config.read("jax_cuda_visible_devices") == "all", "one task per node keeps every local GPU"
    assert distributed.initialize(timeout_s=60, environ={}) is False  # nothing detected: nothing called
    assert distributed.initialize(timeout_s=60, mode="off", environ=SLURM_STEP) is False
    assert len(fake_jax_initialize) == 1


def test_several_tasks_per_node_keep_jax_device_split(fake_jax_initialize):
    import jax

    assert distributed.initialize(environ={**SLURM_STEP, "SLURM_NTASKS": "16"})  # a task per GPU, 8 a node
    assert jax.config.read("jax_cuda_visible_devices") == "0"


def test_initialize_from_args_passes_the_switch(monkeypatch):
    from ulorl_jax.cli import build_parser

    seen = {}
    monkeypatch.setattr(distributed, "initialize", lambda *a, **kw: seen.update(args=a, **kw) or False)
    args = build_parser().parse_args(["train", "--config", "tiny_cpu", "--run-dir", "x", "--distributed", "off",
                                      "--init-timeout", "7"])
    distributed.initialize_from_args(args)
    assert seen == {"args": (None, None, None), "timeout_s": 7, "mode": "off"}
    assert build_parser().parse_args(["train", "--config", "c", "--run-dir", "x"]).distributed == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--config", "c", "--run-dir", "x", "--distributed", "yes"])


def test_jax_errors_become_one_line(monkeypatch):
    """jax's own exceptions (here: `on` where jax finds no cluster) become a ValueError the CLI prints."""
    import jax

    def no_cluster(**kwargs):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    with pytest.raises(ValueError, match=r"--distributed on\) failed: coordinator_address should be defined; "
                                         r"jax found no cluster.*give --coordinator"):
        distributed.join(Launch(), 5)
    with pytest.raises(ValueError, match="timeout must be >= 1|--init-timeout=0"):
        distributed.initialize(timeout_s=0, environ={})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_timeout_message_says_what_the_coordinator_address_shows():
    port = _free_port()
    refused = join_timeout_message(Launch(f"127.0.0.1:{port}", 2, 1), 9)
    assert f"process 1 of 2: could not reach the coordinator at 127.0.0.1:{port} within --init-timeout 9 s" \
           in refused
    assert "refuses connections" in refused and f"TCP port {port}" in refused and "process 0 was started" in refused
    with socket.socket() as server:  # process 0's service is up: the missing piece is another process
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        up = join_timeout_message(Launch(address, 4, 0), 9)
    assert f"process 0 of 4: not every process joined the coordinator at {address}" in up
    assert "accepts connections" in up and "its own process id" in up
    assert "does not resolve" in join_timeout_message(Launch("no-such-host.invalid:1234", 2, 1), 9)


def test_unreachable_coordinator_exits_with_one_paragraph(tmp_path):
    """A real `ulorl train` as process 1 of 2 with nobody at the coordinator: jax 0.10 would abort the process
    (SIGABRT, a C++ stack trace) once its deadline passed; the watchdog exits first with status 2 and one
    paragraph naming the address and the timeout."""
    from trainer_utils import subprocess_env, train_command

    address = f"127.0.0.1:{_free_port()}"
    cmd = train_command(tmp_path / "run", ["--coordinator", address, "--num-processes", "2", "--process-id", "1",
                                           "--init-timeout", "2"])
    done = subprocess.run(cmd, check=False, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"ulorl train: error: process 1 of 2: could not reach the coordinator at {address} within " \
           f"--init-timeout 2 s" in done.stderr
    assert "Traceback" not in done.stderr and "stack trace" not in done.stderr
    assert not (tmp_path / "run").exists(), "nothing is written before the processes have joined"


JOIN = """
from ulorl_jax.distributed import initialize
assert initialize(timeout_s=60)
import jax
print("joined", jax.process_index(), jax.process_count(), jax.device_count())
jax.distributed.shutdown()
"""


def test_auto_joins_a_fake_srun_step_for_real():
    """Two processes with what `srun --ntasks 2` on one node sets, and no flag: jax's own SLURM detection
    (first node of SLURM_STEP_NODELIST, port from JAX_COORDINATOR_PORT) joins them."""
    from trainer_utils import subprocess_env

    env = {**subprocess_env(), "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
           "SLURM_STEP_NUM_NODES": "1", "JAX_COORDINATOR_PORT": str(_free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", JOIN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and f"joined {i} 2 2" in log, log[-3000:]
