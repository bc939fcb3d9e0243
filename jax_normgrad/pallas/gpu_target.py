"""The GPU a lowering targets, and whether Pallas Triton and Mosaic GPU lower for it.

From jax 0.11 Pallas Triton lowers only for the GPU kinds jax lists
(``_compat.triton_gpu_info``) and (0.11.2, 0.12) for an attached GPU named
"NVIDIA ..."; on any other (an attached "Tesla V100", an unlisted kind named
by an abstract device) a Triton kernel raises "No supported GPU devices
found" at ``jit`` time. Before
a lowering picks the Triton kernels, ``triton_problem`` asks jax the same
question its Triton lowering will ask; where the answer is no and the device's
compute capability is known, it registers that with Pallas Triton (what jax
0.10 did unasked: Triton compiled for the device's own capability). Where it
is not known (an abstract device of an unlisted kind, no GPU attached) or this
jax offers no way to register, the Triton kernels cannot run, and
``jax_normgrad._dispatch`` passes to the next implementation of its list (the
Mosaic GPU kernels on sm_90+: ``mosaic_gpu_problem``; else the pure-JAX
reference), with a ``FallbackWarning`` naming the device.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from jax_normgrad import _compat


@dataclasses.dataclass(frozen=True)
class Target:
  """The device a GPU lowering compiles for, as Pallas Triton sees it.

  ``kind``: the device kind (``"NVIDIA H100 80GB HBM3"``); ``platform``: the
  device's platform (``"gpu"``, ``"cuda"``, ``"rocm"``; ``"cpu"`` where no GPU
  is attached and none is named); ``compute_capability``: ``"8.9"``, None
  where unknown (an abstract device has none); ``abstract``: named by the
  abstract mesh (ahead-of-time lowering), not attached.
  """

  kind: str
  platform: str
  compute_capability: str | None = None
  abstract: bool = False

  def describe(self) -> str:
    cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
    where = "abstract device" if self.abstract else f"{self.platform} device"
    return f"{self.kind!r} ({where}{cc})"


def _default_device():
  """The device jax lowers for by default (``jax_default_device``, else the first local one)."""
  device = jax.config.jax_default_device
  if isinstance(device, str):
    return jax.local_devices(backend=device)[0]
  return device or jax.local_devices()[0]


def target() -> Target:
  """The GPU a Pallas lowering targets, chosen as jax 0.11's Triton lowering chooses it.

  The abstract mesh's device (``jax.sharding.use_abstract_mesh``) where it
  names a kind other than the default device's (an ahead-of-time target);
  else the default device.
  """
  device = _default_device()
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None and abstract.device_kind != device.device_kind:
    return Target(abstract.device_kind, abstract.platform, None, abstract=True)
  cc = getattr(device, "compute_capability", None)
  cc = cc if isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc) else None
  return Target(device.device_kind, device.platform, cc)


def _triton_lowers(get_gpu_info) -> bool:
  try:
    get_gpu_info()
  except ValueError:  # what jax's Triton lowering turns into "No supported GPU devices found"
    return False
  return True


def triton_problem(*, register: bool = False) -> str | None:
  """Why Pallas Triton cannot lower for the targeted GPU; None when it can.

  Where jax does not list the device's kind but the device's compute
  capability is known and this jax can register it, Pallas Triton can lower
  once it is registered. ``register``: register it now (a side effect on jax:
  its Triton lowering then accepts that kind for any kernel), as a lowering
  does before it lowers the kernels; else (a query: ``explain``) nothing is
  changed and the answer is the one a lowering would give.
  """
  get_gpu_info = _compat.triton_gpu_info()
  if get_gpu_info is None or _triton_lowers(get_gpu_info):
    return None
  dev = target()
  if dev.platform not in ("gpu", "cuda", "rocm"):
    return (f"Pallas Triton (jax {jax.__version__}) lowers only for a GPU it knows and the "
            f"device it would lower for is {dev.describe()}; with no GPU attached, name one with "
            f"jax.sharding.use_abstract_mesh (an AbstractDevice of a kind it lists)")
  if dev.compute_capability is not None:
    if not register:
      if _compat.triton_gpu_registrable(dev.kind, dev.compute_capability):
        return None
    elif (_compat.register_triton_gpu(dev.kind, dev.compute_capability)
          and _triton_lowers(get_gpu_info)):
      return None
    how = "this jax offers no way to register its compute capability"
  else:
    how = "an abstract device has no compute capability to register"
  return (f"Pallas Triton (jax {jax.__version__}) does not lower for the GPU {dev.describe()}: "
          f"the kind is not in its list (jax.experimental.pallas.triton.get_gpu_info) and {how}")


def mosaic_gpu_problem(*, known_device: bool) -> str | None:
  """Why the Mosaic GPU kernels cannot run on the targeted GPU; None when they can.

  They need sm_90 or newer. ``known_device``: that must be known (a device
  with its compute capability), as where the package picks them by itself
  (standing in for Triton); else (the user named them) only a device known
  to be older refuses them.
  """
  dev = target()
  if dev.compute_capability is None:
    if not known_device:
      return None
    unknown = ("an abstract device has no compute capability" if dev.abstract
               else "no GPU is attached" if dev.platform not in ("gpu", "cuda")
               else "the device's compute capability is unknown")
    return f"they need sm_90+ and {unknown}"
  major, minor = dev.compute_capability.split(".")
  if int(major) < 9:
    return f"they need sm_90+ (the device is sm_{major}{minor})"
  return None
