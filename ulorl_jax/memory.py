"""What a run needs in device memory, checked before anything large is allocated.

`ulorl eval` checks its decode KV cache; `ulorl train` checks the learner's state (weights, gradients and
AdamW's two moments), the rollout's copy of the weights and its KV cache, per device, against the device's
free memory (or 80% of host RAM on CPU, or `--max-memory`). Activations are not counted: `ulorl plan`
compiles the step and gives the whole figure. The point is to refuse a configuration that cannot fit with
a message naming the figure and the options that change it, instead of an out-of-memory kill minutes in.
`PeakRSS` measures what a block of work took (the plan's check against a measured step, the benches).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp

from ulorl_jax.models.config import resolve_dtype


_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float) -> str:
    """`n` bytes in the largest binary unit that keeps the figure >= 1 ('1.50 GiB', '12.25 MiB', '640 B'), so
    that a toy run's figures do not all print as '0.00 GiB'."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value, unit = float(n), "B"
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024:
            break
    return f"{value:.2f} {unit}"


def kv_cache_bytes(model_config, slots: int, max_len: int) -> int:
    """Bytes of the engine's dense KV cache: slots x positions x layers x (K, V) x kv_heads x head_dim."""
    c = model_config
    itemsize = jnp.dtype(resolve_dtype(c.dtype)).itemsize
    return slots * max_len * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * itemsize


def memory_budget(max_memory_gb: float | None) -> tuple[int, str]:
    """(bytes, where the figure comes from): --max-memory, else the first device's free memory, else 80%
    of host RAM (CPU, where every device shares it)."""
    if max_memory_gb is not None:
        return int(max_memory_gb * 2**30), "--max-memory"
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"free memory of {device}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.8 * total), "80% of host RAM"


@dataclasses.dataclass(frozen=True)
class TrainMemory:
    """Bytes per device (summed over the local devices where they share host RAM: CPU)."""

    learner: int  # weights + gradients + AdamW's two moments, as the learner's mesh shards them
    rollout_weights: int  # the engine's own copy (0 when it decodes with the learner's arrays)
    kv_cache: int  # the engine's KV cache, split over its devices by slots

    @property
    def total(self) -> int:
        return self.learner + self.rollout_weights + self.kv_cache


def train_memory(model_config, weight_bytes: int, *, learner_shards: int, decode_kind: str, decode_devices: int,
                 slots: int, max_len: int, shared_host: bool) -> TrainMemory:
    """The learner's and the rollout's memory per device. `weight_bytes`: the whole model at its param dtype;
    `learner_shards`: how many ways the learner's mesh splits it (fsdp x expert x tensor); `decode_kind`: a
    concrete `rollout.decode_mesh`. With `shared_host` (CPU) the per-device figures are summed over devices."""
    learner = 4 * weight_bytes // learner_shards  # params, grads, mu, nu (AdamW's moments take the param dtype)
    rollout = {"learner": 0, "replicate": weight_bytes, "first_device": weight_bytes,
               "shard": weight_bytes // max(decode_devices, 1)}[decode_kind]
    kv = kv_cache_bytes(model_config, slots, max_len) // max(decode_devices, 1)
    if shared_host:
        devices = jax.local_device_count()
        rollout_on = 1 if decode_kind == "first_device" else decode_devices
        return TrainMemory(learner * devices, rollout * rollout_on, kv * max(decode_devices, 1))
    return TrainMemory(learner, rollout, kv)


def check_train_memory(need: TrainMemory, budget: int, where: str, *, slots: int, max_len: int) -> None:
    """Refuse (ValueError) when `need` exceeds `budget`, naming the parts and the options that change them."""
    if need.total <= budget:
        return
    raise ValueError(
        f"this run needs {format_bytes(need.total)} before activations (learner weights, gradients and AdamW "
        f"moments {format_bytes(need.learner)}, rollout weights {format_bytes(need.rollout_weights)}, decode KV "
        f"cache {format_bytes(need.kv_cache)} for {slots} slots x {max_len} positions) but {where} allows "
        f"{format_bytes(budget)}: lower rollout.max_concurrent_decodes (slots), rollout.global_max_len or "
        f"eval.max_new_tokens (positions), shard the model over more devices (mesh.*), or raise --max-memory "
        f"(`ulorl plan` gives the full figure, activations included)")


def _trim_c_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory growth (bytes) of this process while the block runs.

    The C heap is trimmed first: memory that earlier work freed but the allocator kept would otherwise be
    reused without showing as growth, hiding the block's working set (PyTorch's CPU tensors come from that
    heap: its forward at 8k tokens read 64 MiB untrimmed, 146-183 MiB trimmed, in `ulorl bench compare`)."""

    def __enter__(self):
        _trim_c_heap()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.growth = self.peak - self.start
