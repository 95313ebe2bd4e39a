"""What every benchmark shares: the machine it ran on, how much of the CPU it got, timing statistics, peak
memory, and the output contract (a table, then with --json one JSON object as the last line).

Public so that `ulorl plan`, the benches and `benchmarks/` scripts measure and report alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

from ulorl_jax.memory import PeakRSS  # noqa: F401  (the benches' peak-RSS meter, harness.PeakRSS)


def machine_info() -> dict:
    import flax
    import jax
    import jaxlib
    import torch
    import transformers

    cpu_name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu_name = names[0] if names else cpu_name
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu_name, "processor": platform.processor(), "cpu_count": os.cpu_count(), "cpus_usable": usable,
        "platform": platform.platform(), "python": platform.python_version(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "jax_backend": jax.default_backend(), "jax_device": str(jax.devices()[0].device_kind),
        "jax_device_count": jax.device_count(), "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_sample():
    """(system busy CPU-seconds, steal CPU-seconds, this process's CPU-seconds, wall time); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = os.times()
    return ((user + nice + system + irq + softirq) / tick, steal / tick, own.user + own.system,
            time.perf_counter())


def background_load(before, after) -> dict | None:
    """CPU used by other processes (and stolen by the hypervisor) during the timed calls,
    as a fraction of all cores: 0 = we had the machine to ourselves."""
    if before is None or after is None:
        return None
    wall = after[3] - before[3]
    cores = os.cpu_count() or 1
    busy, steal, own = (after[i] - before[i] for i in range(3))
    return {"other_processes_frac": round(max(0.0, busy - own) / (wall * cores), 3),
            "steal_frac": round(steal / (wall * cores), 3),
            "this_process_frac": round(own / (wall * cores), 3)}


def timing_stats(times: list[float], tokens: int) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "tokens_per_s": tokens / med,
            "times_s": times}


NOISY_OTHER_FRAC = 0.1  # other processes' CPU share above which timings are flagged as unreliable


def cpu_load_line(machine: dict) -> str | None:
    """One line on how much of the CPU the timed calls got (None when not measured); shared by every bench."""
    bg = machine.get("cpu_during_timing")
    if not bg:
        return None
    noisy = "  <- noisy: timings unreliable" if bg["other_processes_frac"] > NOISY_OTHER_FRAC else ""
    return (f"CPU during timing (fraction of all cores): this process {bg['this_process_frac']:.2f}, "
            f"other processes {bg['other_processes_frac']:.2f}, steal {bg.get('steal_frac', 0.0):.2f}{noisy}")


def require_torch(what: str) -> None:
    """A clear error, naming the bench, when PyTorch (the `test` extra) is missing for a side-by-side run."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(f"{what} compares against PyTorch: install it with pip install -e '.[test]'") from None


def add_bench_parser(bench_subparsers, name: str, help: str, description: str, add_arguments, cli
                     ) -> argparse.ArgumentParser:
    """Register `ulorl bench NAME`: its options from `add_arguments(parser)`, run by `cli(args)`."""
    p = bench_subparsers.add_parser(name, help=help, description=description,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cli)
    return p


def standalone_main(module: str, description: str, add_arguments, cli, argv: list[str] | None) -> int:
    """`python -m MODULE [options]`: the same bench as `ulorl bench ...`, without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return cli(parser.parse_args(argv))


def print_result(result: dict, table: str, as_json: bool) -> int:
    """The bench output contract: a human table, then (with --json) one JSON object as the last line."""
    print(table)
    if as_json:
        print(json.dumps(result))
    return 0


class CompileCounter:
    """Counts every XLA compile in this process while open (jax.monitoring's backend-compile event), so a
    bench can leave out a timed step during which anything compiled: the engine, the learner, or a helper
    meeting a new shape, which no executable cache of ours would show.

        with CompileCounter() as compiles:
            before = compiles.count; step(); compiled = compiles.count != before
    """

    EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT

    def __init__(self):
        self.count = 0

    def _listener(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)
