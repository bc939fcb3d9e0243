"""What differs between the jax versions this package supports, in one place.

Library code asks here instead of branching on ``jax.__version__`` itself.

* Varying axes inside ``shard_map`` (``check_vma``): jax 0.10 names an
  array type's manual-axes information ``manual_axis_type`` (``aval.mat``, a
  ``ManualAxisType`` whose ``varying`` is the set of mesh axes);
  earlier versions name it ``vma`` (``aval.vma``, the frozenset itself).
* Marking a value varying over manual axes: ``jax.lax.pcast(x, axes,
  to="varying")`` from jax 0.8.2; ``jax.lax.pvary(x, axes)`` before it (the
  same operation, deprecated since).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import NamedTuple

import jax
from jax.extend import core as jax_core

#: The keyword of ``jax.ShapeDtypeStruct`` that carries the varying axes.
_STRUCT_KEYWORD = ("manual_axis_type"
                   if "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct).parameters
                   else "vma")


def _manual_type(aval):
  """The manual-axes part of an abstract value (None outside ``shard_map``)."""
  return getattr(aval, "mat" if _STRUCT_KEYWORD == "manual_axis_type" else "vma", None)


def varying_axes(aval) -> frozenset:
  """The manual mesh axes an abstract value varies over (empty outside ``shard_map``)."""
  t = _manual_type(aval)
  if t is None:
    return frozenset()
  return t.varying if _STRUCT_KEYWORD == "manual_axis_type" else frozenset(t)


def struct_like(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct(shape, dtype)`` varying over the same mesh axes as ``like``.

  Inside ``shard_map`` with ``check_vma=True`` a ``pallas_call``'s ``out_shape``
  must say how its results vary; they vary like the operands they are
  computed from. Outside ``shard_map`` this is the plain struct.
  """
  t = _manual_type(jax.typeof(like))
  if t is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, **{_STRUCT_KEYWORD: t})


def without_varying(aval):
  """``aval`` varying over no mesh axis (itself when it has no manual-axes part).

  For lowering code that must not see ``shard_map``'s types (see
  ``_lowering.register_lowerings``): the types were checked when the
  program was traced, and the lowered HLO carries none.
  """
  t = _manual_type(aval)
  if t is None:
    return aval
  if _STRUCT_KEYWORD == "manual_axis_type":
    return aval.update(manual_axis_type=type(t)())
  return aval.update(vma=frozenset())


def shard_map_of(params: dict):
  """``fun -> jax.shard_map(fun, ...)`` as a ``shard_map`` equation with ``params`` calls it.

  For the rewrite (``jax_normgrad._rewrite``), which evaluates a ``shard_map``
  body again inside a ``shard_map`` of the same mesh, specs, manual axes and
  varying-axes check. None where this jax names the parameters otherwise.
  """
  mesh, in_specs, out_specs, check, axes = (param(params, n)
                                            for n in PRIMITIVES["shard_map"].params)
  if any(v is None for v in (mesh, in_specs, out_specs, check, axes)) or not hasattr(
      jax, "shard_map"):
    return None
  return lambda fun: jax.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                   axis_names=set(axes), check_vma=check)


def pvary(x, axes: tuple):
  """``x`` marked varying over the manual mesh ``axes`` (its transpose is a ``psum``)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)


# ----------------------------------------------------------------------------
# Explicit sharding (``jax_normgrad._sharding``): mesh axes of type
# ``AxisType.Explicit`` put each array's sharding in its type
# (``jax.typeof(x).sharding``, a ``NamedSharding`` over an ``AbstractMesh``),
# changed by ``jax.sharding.reshard``; ``jax.shard_map`` takes that mesh and
# ``axis_names``; ``jax.sharding.get_abstract_mesh`` is the context's. All in
# jax 0.8.1 to 0.12; a jax lacking any of it has no
# explicit sharding, and the ops take the partitioning rule's path.


def _explicit_type():
  axis_type = getattr(jax.sharding, "AxisType", None)
  explicit = getattr(axis_type, "Explicit", None)
  if explicit is None or not all(hasattr(m, n) for m, n in (
      (jax.sharding, "reshard"), (jax.sharding, "get_abstract_mesh"), (jax, "typeof"),
      (jax, "shard_map"))):
    return None
  return explicit


def explicit_axes(mesh) -> tuple[str, ...]:
  """The mesh axes of type Explicit (none with a jax without explicit sharding)."""
  explicit = _explicit_type()
  types = getattr(mesh, "axis_types", None) or ()
  return tuple(n for n, t in zip(mesh.axis_names, types) if explicit is not None and t == explicit)


def manual_axes(mesh, specs) -> frozenset:
  """The ``axis_names`` of a ``shard_map`` over the Explicit axes of ``mesh``.

  Where every axis is Explicit: the empty set, which ``shard_map`` reads as
  all of them but those a ``vmap`` around it maps over (an explicitly
  sharded mapped dim). Else the Explicit axes that ``specs`` (PartitionSpecs)
  name.
  """
  if set(explicit_axes(mesh)) == set(mesh.axis_names):
    return frozenset()
  named = {n for spec in specs for entry in spec if entry is not None
           for n in (entry if isinstance(entry, (tuple, list)) else (entry,))}
  return frozenset(explicit_axes(mesh)) & named


def explicit_mesh(arrays):
  """The mesh of the arrays' sharding types where it has an Explicit axis of more than one device.

  The context's abstract mesh where one is set (``jax.set_mesh``; inside
  ``vmap`` it lacks the axes that shard the mapped dim, as ``shard_map``
  expects), else the arrays' own. None where there is no such mesh (Auto
  axes, one device, a jax without explicit sharding).
  """
  if _explicit_type() is None:
    return None
  context = jax.sharding.get_abstract_mesh()
  meshes = [context] if not context.empty else [
      getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None) for a in arrays]
  for mesh in meshes:
    if mesh is not None and not mesh.empty and any(
        mesh.shape[n] > 1 for n in explicit_axes(mesh)):
      return mesh
  return None


# ----------------------------------------------------------------------------
# Pallas Mosaic GPU (``jax_normgrad.pallas.mosaic_gpu``).
#
# The kernels use ``plgpu.kernel(out_type=, scratch_types=, grid=, grid_names=,
# kernel_name=, interpret=)``, ``SMEM``, ``Barrier(num_arrivals=, num_barriers=)``,
# ``copy_gmem_to_smem``, ``copy_smem_to_gmem``, ``commit_smem``,
# ``wait_smem_to_gmem``, ``barrier_wait``, ``broadcasted_iota`` and
# ``Layout.WG_STRIDED``: all in jax 0.10.2, 0.11.2 and 0.12.0 (``Barrier``'s
# ``num_barriers`` default changed in 0.11, so it is always passed). Older jax
# lacks parts of it: there the backend is unavailable and forcing it raises.
#
# GPU interpret mode (Mosaic GPU kernels simulated on CPU) takes an
# ``InterpretGPUParams`` as ``interpret=``: public as
# ``plgpu.InterpretGPUParams`` in jax 0.12; jax 0.10.2 and 0.11.0 have the same
# class only at its private path, read here and nowhere else. (The kernel API
# names below are public in 0.10.2, 0.11.0 and 0.12.)

_MOSAIC_GPU_NAMES = ("kernel", "SMEM", "Barrier", "copy_gmem_to_smem", "copy_smem_to_gmem",
                     "commit_smem", "wait_smem_to_gmem", "barrier_wait", "broadcasted_iota",
                     "Layout")


def _load_plgpu():
  try:
    from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if not all(hasattr(mosaic_gpu, n) for n in _MOSAIC_GPU_NAMES):
    return None
  if "kernel_name" not in inspect.signature(mosaic_gpu.Mesh).parameters:
    return None
  return mosaic_gpu


def plgpu():
  """``jax.experimental.pallas.mosaic_gpu``; raises if this jax lacks what the kernels use."""
  missing = mosaic_gpu_api_missing()
  if missing:
    raise NotImplementedError(missing)
  return _plgpu_cached()


@functools.lru_cache(maxsize=None)
def _plgpu_cached():
  """Imported on first use: importing Pallas costs ``import jax_normgrad`` about 0.3 s."""
  return _load_plgpu()


def mosaic_gpu_api_missing() -> str | None:
  """Why the Mosaic GPU backend is unavailable with this jax (None when it is available)."""
  if _plgpu_cached() is None or _interpret_params_class() is None:
    return (f"jax {jax.__version__} lacks the Pallas Mosaic GPU API the kernels use "
            f"(jax.experimental.pallas.mosaic_gpu with {', '.join(_MOSAIC_GPU_NAMES)}, "
            f"Mesh(kernel_name=), InterpretGPUParams)")
  return None


def _interpret_params_class():
  module = _plgpu_cached()
  cls = getattr(module, "InterpretGPUParams", None)
  if cls is None:
    try:  # jax 0.10: the same class, not yet exported
      from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
    except ImportError:
      return None
    cls = params.InterpretGPUParams
  return cls


def mosaic_gpu_interpret(interpret: bool):
  """The ``interpret=`` of ``plgpu.kernel``: GPU interpret mode on CPU, else False."""
  return _interpret_params_class()() if interpret else False


# ----------------------------------------------------------------------------
# Pallas Triton's list of GPUs (``jax_normgrad.pallas.gpu_target``).
#
# From jax 0.11 the Triton lowering asks ``get_gpu_info()`` (public in
# ``jax.experimental.pallas.triton``) for the target's architecture, and it
# knows a fixed list of kinds ("NVIDIA A100", "NVIDIA H100", "NVIDIA GeForce
# RTX 4090", ..., ROCm by its gfx name): any other kind raises "No supported
# GPU devices found" when a kernel is lowered. jax 0.10 asked nothing (it
# took the device's compute capability, or sm_90 with no GPU attached). A kind
# the list lacks is added through ``gpu_info.registry`` (kind -> a function
# returning its ``GpuInfo``), which jax has only at a private path, read here
# and nowhere else: ``jax._src.pallas.triton.gpu_info`` in 0.11.0 to 0.12.0,
# ``jax._src.gpu_info`` from 0.12.1 (which also reads an attached "NVIDIA ..."
# GPU's compute capability, as 0.11.2 does).


def triton_gpu_info_module():
  """jax's module of the Triton GPU list (``registry``, ``GpuInfo``), or None where this jax
  has none (before 0.11)."""
  for path in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info"):
    try:
      module = importlib.import_module(path)
    except ImportError:
      continue
    if isinstance(getattr(module, "registry", None), dict):
      return module
  return None


def triton_gpu_info():
  """Pallas Triton's ``get_gpu_info``, or None where this jax lowers for any GPU (before 0.11)."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return getattr(pltriton, "get_gpu_info", None)


def _triton_gpu_entry(device_kind: str, compute_capability: str):
  """``(registry, GpuInfo)`` that would tell Pallas Triton of ``device_kind``; None where this
  jax offers no way to. Changes nothing."""
  del device_kind
  gpu_info = triton_gpu_info_module()
  if gpu_info is None:
    return None
  registry, info_class = gpu_info.registry, getattr(gpu_info, "GpuInfo", None)
  if info_class is None:
    return None
  major, minor = (int(v) for v in compute_capability.split("."))
  try:
    info = info_class(gpu_version=None, arch_name=f"{major}.{minor}",
                      compute_capability=10 * major + minor)
  except TypeError:  # a GpuInfo of other fields
    return None
  return registry, info


def triton_gpu_registrable(device_kind: str, compute_capability: str) -> bool:
  """Whether :func:`register_triton_gpu` can tell Pallas Triton of this kind; registers nothing."""
  return _triton_gpu_entry(device_kind, compute_capability) is not None


def register_triton_gpu(device_kind: str, compute_capability: str) -> bool:
  """Tells Pallas Triton the compute capability (``"8.9"``) of a GPU kind it does not list.

  Returns False where this jax offers no way to (before 0.11 none is
  needed). A kind already registered keeps its entry.
  """
  entry = _triton_gpu_entry(device_kind, compute_capability)
  if entry is None:
    return False
  registry, info = entry
  registry.setdefault(device_kind, lambda: info)
  return True


# ----------------------------------------------------------------------------
# The jaxpr primitives the package reads (``jax_normgrad.rewrite``, ``explain``).
#
# The rewrite reads jaxprs: it inlines calls, rewrites the bodies of control flow and of
# functions with custom rules, evaluates ``checkpoint`` and ``shard_map`` bodies again, and
# sees through a cast to varying. Their primitives' names and parameters are jax's internals,
# not its API: they are named here and nowhere else. ``PRIMITIVES``: each such primitive by
# its role, with the names it has had (the installed jax's among them: ``pjit`` became
# ``jit``, ``checkpoint`` is ``remat2``, ``pvary`` is what ``pcast(to="varying")`` binds in
# jax 0.10) and the parameters read of it ("a|b": whichever of them this jax names).
# tests/test_compat.py builds each role on the installed jax and checks its jaxpr has them.
# A higher-order primitive not in this table is left alone by the rewrite, and its report
# says so.


class JaxprPrimitive(NamedTuple):
  names: tuple  # the names it has had; one of them is the installed jax's
  bodies: tuple  # the parameters holding the jaxprs the rewrite reads (a tuple of them: cond's)
  params: tuple = ()  # the other parameters read ("a|b": whichever of the two this jax names)


PRIMITIVES = {
    # Calls: inlined for the matcher, their body rewritten.
    "jit": JaxprPrimitive(("jit", "pjit"), ("jaxpr",), ("name", "in_shardings", "out_shardings")),
    "closed_call": JaxprPrimitive(("closed_call", "core_call"), ("call_jaxpr",)),
    # Evaluated again under jax.checkpoint with the same policy.
    "checkpoint": JaxprPrimitive(("remat2", "checkpoint", "remat"), ("jaxpr",),
                                 ("prevent_cse", "policy")),
    # Control flow: each body rewritten to a jaxpr of the same signature.
    "scan": JaxprPrimitive(("scan",), ("jaxpr",)),
    "while": JaxprPrimitive(("while",), ("cond_jaxpr", "body_jaxpr")),
    "cond": JaxprPrimitive(("cond",), ("branches",)),
    # Functions with rules of their own: the primal body rewritten, the rules kept.
    "custom_jvp_call": JaxprPrimitive(("custom_jvp_call",), ("call_jaxpr",)),
    "custom_vjp_call": JaxprPrimitive(("custom_vjp_call",), ("call_jaxpr",)),
    # Evaluated again under jax.shard_map (``shard_map_of``).
    "shard_map": JaxprPrimitive(("shard_map",), ("jaxpr",), (
        "mesh", "in_specs", "out_specs", "check_vma|check_rep", "newly_manual_axes|manual_axes")),
    # A value made varying over manual mesh axes (``is_varying_cast``): the same value.
    "pvary": JaxprPrimitive(("pvary", "pcast"), ()),
}


#: The first-order primitives the rewrite reads by name: the matcher's algebra of a norm's
#: statistics and affine (``_rewrite/_match.py``), the graph's constant folding
#: (``_graph.py``) and an activation's steps (``_identify.py``), with the parameters it reads
#: of them (``params`` of each entry; ``bodies`` is empty). Equally jax's internals:
#: tests/test_compat.py builds each on the installed jax and checks its name and parameters,
#: and checks that the rewrite's modules name no other primitive of ``jax.lax``.
LAX_PRIMITIVES = {
    name: JaxprPrimitive(names, (), params) for name, names, params in (
        # Arithmetic: the algebra's operations and an activation's steps.
        ("add", ("add",), ()), ("sub", ("sub",), ()), ("mul", ("mul",), ()),
        ("div", ("div",), ()), ("neg", ("neg",), ()), ("max", ("max",), ()),
        ("min", ("min",), ()), ("pow", ("pow",), ()), ("integer_pow", ("integer_pow",), ("y",)),
        ("square", ("square",), ()), ("sqrt", ("sqrt",), ()), ("rsqrt", ("rsqrt",), ()),
        ("abs", ("abs",), ()), ("exp", ("exp",), ()), ("tanh", ("tanh",), ()),
        ("logistic", ("logistic",), ()), ("erf", ("erf",), ()),
        # Comparisons and selects: an activation's masks (``where``, ``y * (y > 0)``).
        ("ge", ("ge",), ()), ("gt", ("gt",), ()), ("le", ("le",), ()), ("lt", ("lt",), ()),
        ("select_n", ("select_n",), ()),
        # Reductions: the statistics (a sum over the normalized axes, a contraction by ones).
        ("reduce_sum", ("reduce_sum",), ("axes",)),
        ("dot_general", ("dot_general",), ("dimension_numbers",)),
        # Layout: how a value's dims map onto x's.
        ("broadcast_in_dim", ("broadcast_in_dim",), ("broadcast_dimensions",)),
        ("reshape", ("reshape",), ("dimensions",)), ("squeeze", ("squeeze",), ("dimensions",)),
        ("transpose", ("transpose",), ("permutation",)),
        # The same value: casts (``new_dtype`` read), copies and barriers.
        ("convert_element_type", ("convert_element_type",), ("new_dtype",)),
        ("copy", ("copy", "copy_p"), ()), ("reduce_precision", ("reduce_precision",), ()),
        ("optimization_barrier", ("optimization_barrier",), ()),
    )
}


def jaxprs_in_params(params: dict):
  """The jaxprs (open ones; a ``ClosedJaxpr``'s ``jaxpr``) an equation's ``params`` hold, as
  ``jax.extend.core.jaxprs_in_params`` gives them (which jax 0.8 lacks)."""
  public = getattr(jax_core, "jaxprs_in_params", None)
  if public is not None:
    yield from public(params)
    return
  for value in params.values():
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, jax_core.Jaxpr):
        yield v
      elif isinstance(v, jax_core.ClosedJaxpr):
        yield v.jaxpr


def primitive_names(*roles: str) -> frozenset:
  """Every name the primitives of ``roles`` (keys of ``PRIMITIVES``) have had."""
  return frozenset(n for r in roles for n in PRIMITIVES[r].names)


def bodies(name: str) -> tuple:
  """The parameters holding the jaxprs of the primitive ``name`` that the rewrite reads; () for
  a primitive not in ``PRIMITIVES`` (or one with no body)."""
  return next((p.bodies for p in PRIMITIVES.values() if name in p.names), ())


def param(params: dict, name: str, default=None):
  """The parameter ``name`` ("a|b": the first of them present) of an equation's ``params``."""
  for n in name.split("|"):
    if n in params:
      return params[n]
  return default


def is_varying_cast(eqn) -> bool:
  """Whether the equation makes its one operand varying over mesh axes (its value unchanged)."""
  name = eqn.primitive.name
  # A jax that binds ``pcast`` itself says where to in its parameter ``to``.
  return len(eqn.invars) == 1 and len(eqn.outvars) == 1 and name in PRIMITIVES["pvary"].names and (
      name != "pcast" or str(eqn.params.get("to", "")).endswith("varying"))


# ----------------------------------------------------------------------------
# Evaluating a jaxpr equation (``jax_normgrad.rewrite``).


def bind_equation(eqn, invals):
  """``eqn.primitive.bind`` of the equation's params on ``invals``, as ``jax.core.eval_jaxpr`` does.

  ``Primitive.get_bind_params`` returns ``(subfuns, params)`` up to jax 0.9
  and the params alone (the subfunctions inside them) from jax 0.10.
  """
  got = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(got, tuple):
    subfuns, params = got
  else:
    subfuns, params = (), got
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is None:
    return eqn.primitive.bind(*subfuns, *invals, **params)
  with ctx:
    return eqn.primitive.bind(*subfuns, *invals, **params)


#: ``jax.extend.core.DropVar`` where that module exports it.
_DROP_VAR = getattr(jax_core, "DropVar", None)


def is_drop_var(v) -> bool:
  """Whether the jaxpr variable ``v`` is a dropped output (printed ``_``)."""
  if _DROP_VAR is not None:
    return isinstance(v, _DROP_VAR)
  # jax.extend.core of jax 0.8.1 exports no DropVar; its class bears the name.
  return type(v).__name__ == "DropVar"
