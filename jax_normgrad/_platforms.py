"""The platforms the package lowers for, and what each one runs: decided here, read elsewhere.

A platform is one of jax's lowering platforms (:data:`PLATFORMS`). Which
one a program is lowered for is known only when it is lowered (an export may
lower one program for several), so the package decides per platform in
two places of the lowering, both built from the tables below:

* each primitive has one lowering rule per platform
  (:func:`register_per_platform`; the dispatcher, ``_dispatch.choose``,
  picks an implementation for that platform);
* code staged before lowering that differs by platform is one
  :func:`switch` (``lax.platform_dependent``), whose branch jax keeps for the
  platform being lowered: the Pallas kernels' family (:data:`KERNELS`:
  ``pallas.kernels.dispatch``) and where XLA's partitioner runs the
  layers' ``custom_partitioning`` rules (:data:`CUSTOM_PARTITIONING`:
  ``_sharding``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.extend.backend
from jax import lax
from jax.interpreters import mlir

#: jax's lowering platforms the package registers rules for.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
#: The GPU platforms.
GPUS = ("cuda", "rocm")
#: The compiled Pallas kernels each platform runs ("gpu": Triton's or Mosaic GPU's, as the
#: dispatcher chose; "tpu": Mosaic TPU's). The CPU runs them interpreted, by the backend's name.
KERNELS = {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
#: The platforms whose compiler calls ``custom_partitioning``'s callbacks: not libtpu's
#: (jax-ml/jax#38196: "Custom emitter for CustomSPMDPartitioning not found").
CUSTOM_PARTITIONING = ("cpu", "cuda", "rocm")


def default_platform() -> str:
  """The lowering platform ("cpu", "cuda", "rocm", "tpu") of JAX's default backend.

  ``jax.default_backend()`` says "gpu" for CUDA and ROCm alike; lowerings are
  registered per platform, and the backend's platform version tells the two apart.
  """
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  version = jax.extend.backend.get_backend().platform_version.lower()
  return "rocm" if "rocm" in version else "cuda"


def platform_or_default(platform: str | None) -> str:
  """``platform`` checked, or :func:`default_platform` for None."""
  platform = default_platform() if platform is None else platform
  if platform not in PLATFORMS:
    raise ValueError(f"platform: expected one of {PLATFORMS} (or None), got {platform!r}")
  return platform


def register_per_platform(prim, make_rule: Callable[[str], Callable]) -> None:
  """Registers ``make_rule(platform)`` as ``prim``'s lowering rule on each of :data:`PLATFORMS`."""
  for platform in PLATFORMS:
    mlir.register_lowering(prim, make_rule(platform), platform=platform)


def kernels_switch(*args, gpu: Callable, tpu: Callable):
  """``gpu(*args)`` where :data:`KERNELS` says "gpu", ``tpu(*args)`` where it says "tpu",
  staged: the branch of the platform being lowered is the only one compiled."""
  family = {"gpu": gpu, "tpu": tpu}
  return lax.platform_dependent(*args, **{p: family[k] for p, k in KERNELS.items()})


def partitioning_switch(*args, partitioned: Callable, plain: Callable):
  """``partitioned(*args)`` on the platforms of :data:`CUSTOM_PARTITIONING`, else ``plain(*args)``,
  staged as :func:`kernels_switch`."""
  others = {p: plain for p in PLATFORMS if p not in CUSTOM_PARTITIONING}
  return lax.platform_dependent(*args, **others, default=partitioned)
