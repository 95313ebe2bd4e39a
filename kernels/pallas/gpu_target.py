"""Lowering GPU kernels for a GPU that is not here (export / AOT / CPU-only tests).

Pallas needs to know which GPU it lowers for: the Triton backend picks the
compute capability Triton targets, Mosaic GPU the architecture (sm90 for
Hopper). With no local GPU, jax >= 0.12 reads it from the ``AbstractDevice`` of
the current abstract mesh (``jax._src.pallas.triton.gpu_info`` maps the device
kind, e.g. "NVIDIA H100 ...", to compute capability 90) and otherwise raises
"No supported GPU devices found, please specify an abstract GPU device using
AbstractDevice". Older jax (0.10.x) ignores the abstract device and lowers for
sm90 when no GPU is present, so the same code serves both::

    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh()):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], ...)(*specs)

Mosaic GPU on jax 0.12 asks the abstract device for ``compute_capability``,
which ``AbstractDevice`` lacks, and falls back to sm90: an H100 target is what
both backends lower for.
"""

from __future__ import annotations

from jax.sharding import AbstractDevice, AbstractMesh, AxisType

__all__ = ["H100", "H200", "abstract_gpu_mesh"]

# device_kind strings as the CUDA runtime reports them; num_cores = SM count.
H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def abstract_gpu_mesh(device: AbstractDevice = H100) -> AbstractMesh:
    """A one-device abstract mesh on ``device``; enter it with ``jax.sharding.use_abstract_mesh``.

    The axis is Auto (the default on jax 0.10, not on 0.12, where it is Explicit): the mesh only
    names the target GPU and must not turn on sharding-in-types, under which e.g.
    ``lax.ragged_dot`` refuses to lower ("Explicit sharding inference ... not implemented").
    """
    return AbstractMesh((1,), ("gpu",), axis_types=(AxisType.Auto,), abstract_device=device)
