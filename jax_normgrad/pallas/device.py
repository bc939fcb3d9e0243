"""The figures of the device a lowering compiles for: SMs and shared memory of a GPU, TPU cores.

:func:`for_platform` reads them, when an op is lowered, from the device jax
targets (``gpu_target.target``: the default device, or the abstract mesh's),
from the attached device where there is one and from tables of known GPUs
where there is none (an export with no GPU); an H100's where nothing is
known. The plans of ``config`` read them through ``overrides.device``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_normgrad.pallas.backend_config import MosaicGpuConfig

#: Shared memory of a GPU block and of an SM (bytes) by compute capability (major, minor);
#: CUDA's limits (an opt-in block may use all but 1 KiB of its SM's).
_SMEM_BY_CAPABILITY = {(7, 0): 96, (7, 5): 64, (8, 0): 164, (8, 6): 100, (8, 7): 164,
                       (8, 9): 100, (9, 0): 228, (10, 0): 228, (12, 0): 100}
#: SMs by the device kinds whose count is known, for an abstract device (export with no GPU).
_SMS_BY_KIND = (("H100 PCIe", 114), ("H100", 132), ("H200", 132), ("H20", 78), ("A100", 108),
                ("B200", 148), ("L40", 142), ("L4", 58), ("A10", 72))


@dataclasses.dataclass(frozen=True)
class Device:
  """The figures of the device a lowering compiles for (:func:`for_platform`); an H100's by default.

  ``sms``: streaming multiprocessors of the GPU; ``smem_per_sm``: shared
  memory of an SM (bytes); ``mosaic_gpu_smem_bytes``: what one Mosaic GPU CTA
  plans with (the block's limit less ``MosaicGpuConfig.mosaic_gpu_smem_reserve``);
  ``tpu_cores``: TensorCores sharing a TPU chip's grid ("parallel" axis; 2
  on megacore chips; on single-core chips the two halves run in turn).
  """

  sms: int = 132
  smem_per_sm: int = 228 * 1024
  mosaic_gpu_smem_bytes: int = 200 * 1024
  tpu_cores: int = 2


def for_platform(platform: str) -> Device:
  """The figures of the device jax compiles for on ``platform`` (an H100's where unknown)."""
  if platform in ("cuda", "rocm"):
    return gpu_device(*_gpu_target())
  if platform == "tpu":
    cores = _attached_tpu_cores()
    return Device(tpu_cores=cores) if cores else Device()
  return Device()


def _gpu_target() -> tuple[str, str | None, int | None]:
  """(kind, compute capability, SM count) of the GPU a lowering targets, None where unknown."""
  from jax_normgrad.pallas import gpu_target  # pylint: disable=g-import-not-at-top
  dev = gpu_target.target()
  return dev.kind, dev.compute_capability, None if dev.abstract else _attached_sms()


@functools.lru_cache(maxsize=None)
def gpu_device(kind: str, capability: str | None, sms: int | None) -> Device:
  default = Device()
  if sms is None:
    sms = next((n for name, n in _SMS_BY_KIND if name in kind), default.sms)
  smem = None
  if capability is not None:
    major, minor = (int(v) for v in capability.split("."))
    smem = _SMEM_BY_CAPABILITY.get((major, minor)) or _SMEM_BY_CAPABILITY.get((major, 0))
  if smem is None:
    return dataclasses.replace(default, sms=sms)
  per_sm = smem * 1024
  budget = per_sm - 1024 - MosaicGpuConfig().mosaic_gpu_smem_reserve
  return Device(sms=sms, smem_per_sm=per_sm, mosaic_gpu_smem_bytes=budget,
                tpu_cores=default.tpu_cores)


@functools.lru_cache(maxsize=None)
def _attached_sms() -> int | None:
  """The SM count of an attached GPU, None when tracing without one (export)."""
  for backend in ("cuda", "rocm"):
    try:
      devices = jax.devices(backend)
    except RuntimeError:
      continue
    count = getattr(devices[0], "core_count", None)
    if count:
      return int(count)
  return None


@functools.lru_cache(maxsize=None)
def _attached_tpu_cores() -> int | None:
  """TensorCores per chip of an attached TPU, None without one."""
  try:
    devices = jax.devices("tpu")
  except RuntimeError:
    return None
  cores = getattr(devices[0], "num_cores", None)
  return int(cores) if cores else None
