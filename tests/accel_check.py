"""The accelerator kernels compiled by their real compilers, on a machine with no accelerator.

Interpret mode and ``jax.export`` lowering check what the Pallas kernels
compute and that they lower; neither runs the compiler a GPU or TPU user's
process runs. This tool does, for every kernel the library can launch (the
cases of :data:`CASES`):

* **GPU (Triton).** Each Pallas Triton kernel that a case lowers to for
  ``cuda`` is captured as Triton IR text (TTIR) with its launch parameters
  (``num_warps``, ``num_stages``), compiled by the ``triton`` package for
  sm_80 and sm_90 (``triton.compile(path, target=GPUTarget("cuda", cc, 32),
  options=...)``), and its cubin read with the ``cuobjdump`` that Triton
  ships: registers, local memory (spills), shared memory, and the global
  loads and stores by width (``LDG.E.128`` moves 16 bytes per thread).
* **TPU (Mosaic).** Each case is compiled with libtpu's compiler, Mosaic
  included, for v4, v5e, v5p and v6e topologies described without a TPU
  (``jax.experimental.topologies.get_topology_desc``); a kernel Mosaic cannot
  compile fails there. So is a training step of a small model with every norm
  (``tests/norm_model.py``) jitted with Explicit mesh axes over a v5e 2x2
  topology (``compile_tpu_model_step``): the kernels per chip.

Why it reaches into JAX's internals (a test tool, not library code): the
TTIR is only available inside the Pallas Triton lowering. The exported
module carries it as MLIR bytecode that the ``triton`` package's MLIR does
not read, and ``pallas_call(debug=True)`` only prints it; so the tool wraps
``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` while a
case is lowered, and reads the launch parameters from its caller. From jax 0.11 the Triton lowering
asks for the GPU's device kind (``pallas_call_registration``: no GPU raises "No
supported GPU devices found"; 0.10 assumed sm_90), so the GPU half runs under
jax 0.10.x (what the ``accel-check`` extra pins).

Requirements: ``pip install ".[accel-check]"`` (``triton``, ``jax[tpu]``);
for TPU, ``TPU_WORKER_HOSTNAMES=localhost`` in the environment (set here
when absent) and JAX_PLATFORMS not forcing ``cpu`` (with it, JAX resolves
``lax.platform_dependent`` for the CPU while tracing). Run as a script::

    python tests/accel_check.py                      # both checks, a summary
    python tests/accel_check.py --gpu-report docs/gpu-resources.md   # the resource table

``tests/test_accel_compile.py`` runs the same checks under pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Callable, Iterator

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Triton 3.9's default (fused multiply-adds on), without its warning that the default will change.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_normgrad as jn  # noqa: E402
from jax_normgrad.pallas import config  # noqa: E402
import cases  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
GPU_ARCHS = (80, 90)
TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
TRITON_TARGET = "__gpu$xla.gpu.triton"


# ----------------------------------------------------------------------------
# The cases: every kernel configuration the library can launch.


@dataclasses.dataclass(frozen=True)
class Case:
  """A function and its argument types; ``pallas`` is the least number of Pallas calls it lowers to
  (2 for a layer's gradient: the forward and the backward kernel)."""

  name: str
  fn: Callable
  args: tuple
  pallas: int = 1
  #: ``config.override`` settings the case is lowered under, as ``(key, value)`` pairs.
  tuning: tuple = ()


def _s(shape, dtype=F32):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _grad(layer, argnums=(0, 1, 2)):
  return jax.grad(lambda *a: jnp.sum(layer(*a).astype(F32) ** 2), argnums=argnums)


def _ln_cases(hidden, dtype, rows=64):
  x, p = _s((rows, hidden), dtype), _s((hidden,), dtype)
  tag = f"{rows}x{hidden} {jnp.dtype(dtype).name}"
  return [
      Case(f"grad(layer_norm) {tag}", _grad(jn.layer_norm), (x, p, p), 2),
      Case(f"grad(rms_norm) {tag}", _grad(jn.rms_norm, (0, 1)), (x, p), 2),
  ]


def _gn_cases(shape, groups, channel_axis, dtype):
  c = shape[channel_axis]
  layer = lambda x, w, b: jn.group_norm(x, groups, w, b, channel_axis=channel_axis)
  layout = "NCHW" if channel_axis == 1 else "NHWC"
  return [Case(f"grad(group_norm) {layout} {'x'.join(map(str, shape))}/{groups} "
               f"{jnp.dtype(dtype).name}", _grad(layer), (_s(shape, dtype), _s((c,), dtype),
                                                         _s((c,), dtype)), 2)]


def _op_cases():
  """The ops and options beyond the layers' defaults, at one odd width."""
  h, m = 1000, 48
  x, dy, p = _s((m, h)), _s((m, h)), _s((h,))
  st = _s((m, 1))
  cases = []
  for mask in [(True, True, True), (True, False, False), (False, True, True), (False, True, False),
               (False, False, True), (True, True, False)]:
    fn = lambda dy, x, mean, rstd, w, b, mask=mask: jn.layer_norm_backward(
        dy, x, h, mean, rstd, w, b, output_mask=mask)
    cases.append(Case(f"layer_norm_backward mask={''.join('1' if k else '0' for k in mask)}",
                      fn, (dy, x, st, st, p, p)))
  cases += [
      Case("layer_norm_backward no weight/bias",
           lambda dy, x, mean, rstd: jn.layer_norm_backward(dy, x, h, mean, rstd),
           (dy, x, st, st)),
      Case("rms_norm_backward mask=01",
           lambda dy, x, rstd, w: jn.rms_norm_backward(dy, x, h, rstd, w, (False, True)),
           (dy, x, st, p)),
      Case("layer_norm_fwd no weight/bias", lambda x: jn.layer_norm_fwd(x, h), (x,)),
      Case("rms_norm_fwd", lambda x, w: jn.rms_norm_fwd(x, h, w), (x, p)),
      Case("grad(layer_norm) bfloat16 x, bfloat16 params (16-bit parameters)",
           _grad(jn.layer_norm), (_s((m, h), BF16), _s((h,), BF16), _s((h,), BF16)), 2),
      Case("grad(layer_norm) bfloat16 x, float32 params, out_dtype=float32",
           _grad(lambda x, w, b: jn.layer_norm(x, w, b, out_dtype=F32)),
           (_s((m, h), BF16), p, p), 2),
      # A float32 stream's norm feeding bfloat16 matmuls: the forward writes the bfloat16 y,
      # the backward reads the bfloat16 dy beside the float32 x.
      *[Case(f"grad({name}) float32 x, out_dtype=bfloat16",
             _grad(lambda x, w, fn=fn: fn(x, w, out_dtype=BF16), argnums=(0, 1)),
             (_s((m, h)), p), 2)
        for name, fn in (("layer_norm", jn.layer_norm), ("rms_norm", jn.rms_norm))],
      # The backward reads the bfloat16 x and the float32 dy each in its own dtype.
      *[Case(f"grad(group_norm) {layout} bfloat16 x, float32 params, out_dtype=float32",
             _grad(lambda x, w, b, axis=axis: jn.group_norm(x, 8, w, b, channel_axis=axis,
                                                           out_dtype=F32)),
             (_s(shape, BF16), _s((64,)), _s((64,))), 2)
        for layout, axis, shape in (("NCHW", 1, (4, 64, 16, 16)), ("NHWC", -1, (4, 16, 16, 64)))],
      Case("grad(layer_norm save='normalized')",
           _grad(lambda x, w, b: jn.layer_norm(x, w, b, save="normalized")), (x, p, p), 2),
      Case("layer_norm_grad (AscendC)",
           lambda dy, x, var, mean, g: jn.layer_norm_grad(dy, x, var, mean, g, 1e-5),
           (dy, x, st, st, p)),
      Case("layer_norm_grad_beta (AscendC)", lambda dy, r: jn.layer_norm_grad_beta(dy, r, h),
           (dy, x)),
      Case("layer_norm_backward_from_normalized (InfiniOp)",
           lambda dy, w, xhat, std: jn.layer_norm_backward_from_normalized(dy, w, xhat, std),
           (dy, p, x, _s((m,)))),
      Case("grad(group_norm) NCHW no weight/bias",
           _grad(lambda x: jn.group_norm(x, 4), (0,)), (_s((2, 24, 5, 7)),), 2),
      Case("group_norm_fwd NHWC", lambda x, g, b: jn.group_norm_fwd(
          x, g, b, 2, 24, 35, 4, channels_last=True), (_s((2, 5, 7, 24)), _s((24,)), _s((24,)))),
      *[Case(f"group_norm_backward {layout} mask={''.join('1' if k else '0' for k in mask)}",
             lambda dy, x, m, r, g, mask=mask, cl=cl: jn.group_norm_backward(
                 dy, x, m, r, g, 2, 24, 35, 4, mask, channels_last=cl),
             (_s(shape), _s(shape), _s((2, 4)), _s((2, 4)), _s((24,))))
        for layout, cl, shape in [("NCHW", False, (2, 24, 5, 7)), ("NHWC", True, (2, 5, 7, 24))]
        for mask in [(True, False, False), (False, True, True), (False, False, True)]],
      Case("vmap(grad(layer_norm)) per-example weights",
           jax.vmap(_grad(jn.layer_norm)), (_s((3, 16, h)), _s((3, h)), _s((3, h))), 2),
      Case("vmap(grad(group_norm NHWC)) per-example weights",
           jax.vmap(_grad(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1))),
           (_s((3, 2, 9, 9, 24), BF16), _s((3, 24), BF16), _s((3, 24), BF16)), 2),
      # The fused activations (exp in the output pass and in the backward's).
      Case("grad(group_norm activation=silu) NHWC 8x32x32x320/32 bfloat16",
           _grad(lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=-1,
                                               activation="silu")),
           (_s((8, 32, 32, 320), BF16), _s((320,), BF16), _s((320,), BF16)), 2),
      Case("grad(group_norm activation=gelu) NCHW 8x128x16x16/32 float32",
           _grad(lambda x, w, b: jn.group_norm(x, 32, w, b, activation="gelu")),
           (_s((8, 128, 16, 16)), _s((128,)), _s((128,))), 2),
  ]
  return cases


def _residual_cases():
  """The residual form's fused kernels (x and residual in, h and y out; dh into dx), forward and
  backward, at a transformer's shape: LayerNorm float32 and bfloat16, RMSNorm bfloat16 with a
  float32 residual stream (residual_dtype=float32)."""
  x32, xbf, p = _s((8192, 1024)), _s((8192, 1024), BF16), _s((1024,))

  def grad(fn, **kw):
    def loss(x, r, *params):
      y, h = fn(x, r, *params, **kw)
      return jnp.sum(y.astype(F32) ** 2) + jnp.sum(jnp.sin(h.astype(F32)))
    return jax.grad(loss, argnums=tuple(range(2 + (fn is jn.add_layer_norm) * 2)))

  x32_long, p_long = _s((16384, 4096)), _s((4096,))
  return [
      Case("grad(add_layer_norm) 8192x1024 float32", grad(jn.add_layer_norm), (x32, x32, p, p), 2),
      # Rows enough for two backward programs per SM: with dh, weight and bias its float32
      # tile of 4096 took 86 registers (one program resident) until the partials were summed
      # before dx (2026-11-26).
      Case("grad(add_layer_norm) 16384x4096 float32", grad(jn.add_layer_norm),
           (x32_long, x32_long, p_long, p_long), 2),
      Case("grad(add_layer_norm) 8192x1024 bfloat16", grad(jn.add_layer_norm), (xbf, xbf, p, p), 2),
      Case("grad(add_rms_norm) 8192x1024 bfloat16, residual_dtype=float32",
           grad(lambda x, r: jn.add_rms_norm(x, r, residual_dtype=F32)), (xbf, x32), 2),
  ]


def _cases() -> list[Case]:
  cases = []
  for dtype in (F32, BF16, F16):
    for hidden in (768, 1000, 4096, 5120, 12288, 65536):
      cases += _ln_cases(hidden, dtype)
  cases += _ln_cases(1 << 20, F32, rows=4) + _ln_cases(1 << 20, BF16, rows=4)
  for dtype in (F32, BF16, F16):
    cases += _gn_cases((8, 320, 16, 16), 32, 1, dtype)     # 10 channels per group
    cases += _gn_cases((8, 16, 16, 320), 32, -1, dtype)    # C not a multiple of 128
  cases += _gn_cases((4, 512, 64, 64), 32, 1, F32) + _gn_cases((4, 64, 64, 512), 32, -1, F32)
  cases += _gn_cases((2, 96, 7, 9), 3, 1, BF16) + _gn_cases((2, 7, 9, 96), 3, -1, BF16)
  # A UNet's channels-last GroupNorms, 32 groups of 2 to 8 channels: the sample-wide kernels
  # (config.gpu_nhwc_plan), chunked at 32x32 pixels, one tile at 8x8.
  for dtype in (F32, BF16):
    cases += _gn_cases((32, 32, 32, 64), 32, -1, dtype) + _gn_cases((32, 8, 8, 256), 32, -1, dtype)
  return cases + _op_cases() + _residual_cases()


CASES: list[Case] = _cases()
#: The Triton checks' cases: CASES and the tunings that change only the GPU kernels. The SD-class
#: UNet's channels-last GroupNorms with ``gpu_nhwc_odd_groups`` (groups of 10 and 20 channels in
#: the sample-wide kernels).
GPU_CASES: list[Case] = CASES + [
    dataclasses.replace(case, name=case.name + " odd groups",
                        tuning=(("gpu_nhwc_odd_groups", True),))
    for dtype in (F32, BF16)
    for case in _gn_cases((8, 32, 32, 320), 32, -1, dtype) + _gn_cases((8, 16, 16, 640), 32, -1,
                                                                        dtype)]


@contextlib.contextmanager
def _no_fallback() -> Iterator[None]:
  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    yield


# ----------------------------------------------------------------------------
# GPU: capture the Triton kernels, compile them, read their resources.


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  name: str
  ttir: str
  num_warps: int
  num_stages: int
  grid: int  # programs launched

  @property
  def programs_per_sm(self) -> int:
    """Programs each SM must hold at once for the whole grid to be resident (an H100's SMs:
    the count the tile heuristics plan for when exporting with no GPU attached)."""
    return -(-self.grid // config.device().sms)

  @property
  def tile_elems(self) -> int:
    """Elements of the kernel's largest tensor (its tile): the register working set's driver."""
    shapes = re.findall(r"tensor<((?:\d+x)+)", self.ttir)
    return max((int(np.prod([int(d) for d in sh.rstrip("x").split("x")])) for sh in shapes),
               default=1)


@contextlib.contextmanager
def _capture_triton() -> Iterator[list[TritonKernel]]:
  """Records every Pallas Triton kernel lowered inside the block (see the module docstring).

  The module comes from ``lower_jaxpr_to_triton_module``; the launch
  parameters are the ``num_warps`` / ``num_stages`` that jax 0.10's
  ``pallas_call_lowering`` (its caller) has resolved just before.
  """
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top

  captured: list[TritonKernel] = []
  lower_module = lowering.lower_jaxpr_to_triton_module

  def module(*args, **kwargs):
    result = lower_module(*args, **kwargs)
    launch = sys._getframe(1).f_locals  # pylint: disable=protected-access
    text = result.module.operation.get_asm()
    name = re.search(r"tt\.func (?:public )?@([\w$.]+)", text).group(1)
    grid = int(np.prod(result.grid))
    captured.append(TritonKernel(name, text, launch["num_warps"], launch["num_stages"], grid))
    return result

  lowering.lower_jaxpr_to_triton_module = module
  try:
    yield captured
  finally:
    lowering.lower_jaxpr_to_triton_module = lower_module


@functools.lru_cache(maxsize=None)
def triton_kernels(case: Case) -> tuple[TritonKernel, ...]:
  """The distinct Triton kernels ``case`` lowers to for cuda (fails on a fallback).

  Cached: JAX caches lowerings, so a second export of the case would not reach the
  Triton lowering that captures the kernels."""
  with _no_fallback(), _capture_triton() as captured, config.override(**dict(case.tuning)):
    text = jax.export.export(
        jax.jit(case.fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)])(
            *case.args).mlir_module()
  calls = text.count(f"@{TRITON_TARGET}(") + text.count(f'"{TRITON_TARGET}"')
  if calls < case.pallas or len(captured) < 1:
    raise AssertionError(f"{case.name}: {calls} Triton calls, expected >= {case.pallas}")
  return tuple(dict.fromkeys(captured))


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one compiled kernel uses, per thread (registers, spills) and per block (shared)."""

  registers: int
  local_bytes: int       # local memory per thread: > 0 means spills
  shared_bytes: int
  num_warps: int

  @property
  def blocks_per_sm(self) -> int:
    """Resident blocks per SM from registers and warps (64K registers, 64 warps, 32 blocks; sm_80/90)."""
    threads = 32 * self.num_warps
    regs = max(self.registers, 1)
    # Registers are allocated per warp in units of 256.
    per_warp = -(-regs * 32 // 256) * 256
    return max(min(65536 // (per_warp * self.num_warps), 64 // self.num_warps, 32,
                   2048 // threads), 0)


@dataclasses.dataclass(frozen=True)
class Accesses:
  """One compiled kernel's global loads and stores by width, counted in its machine code."""

  loads_128: int         # LDG.E.128 instructions
  loads_narrow: int      # other LDG instructions
  stores_128: int
  stores_narrow: int


def _tools_dir() -> pathlib.Path:
  import triton  # pylint: disable=g-import-not-at-top
  return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@functools.lru_cache(maxsize=None)
def _cubin(kernel: TritonKernel, arch: int) -> bytes:
  """``kernel`` compiled by Triton for ``sm_{arch}`` (cached: cases share kernels)."""
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    src = pathlib.Path(tmp) / f"{kernel.name}.ttir"
    src.write_text(kernel.ttir)
    compiled = triton.compile(str(src), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": kernel.num_warps,
                                       "num_stages": kernel.num_stages})
    return compiled.asm["cubin"]


def _cuobjdump(kernel: TritonKernel, arch: int, option: str) -> str:
  """What ``cuobjdump OPTION`` prints of the kernel's cubin for ``sm_{arch}``."""
  with tempfile.TemporaryDirectory() as tmp:
    cubin = pathlib.Path(tmp) / "k.cubin"
    cubin.write_bytes(_cubin(kernel, arch))
    return subprocess.run([str(_tools_dir() / "cuobjdump"), option, str(cubin)], check=True,
                          capture_output=True, text=True).stdout


@functools.lru_cache(maxsize=None)
def compile_triton(kernel: TritonKernel, arch: int) -> Resources:
  """Compiles ``kernel`` for ``sm_{arch}`` and reads its cubin's resource usage (cached)."""
  usage = _cuobjdump(kernel, arch, "--dump-resource-usage")
  field = lambda key: int(re.search(rf"{key}:(\d+)", usage).group(1))
  return Resources(registers=field("REG"), local_bytes=field("STACK") + field("LOCAL"),
                   shared_bytes=field("SHARED"), num_warps=kernel.num_warps)


@functools.lru_cache(maxsize=None)
def memory_accesses(kernel: TritonKernel, arch: int) -> Accesses:
  """The global loads and stores of ``kernel``'s cubin for ``sm_{arch}`` by width, from its
  disassembly (cached; apart from :func:`compile_triton`: disassembling takes most of a
  kernel's check, and only the access-width test and the report need it)."""
  sass = _cuobjdump(kernel, arch, "-sass")
  ldg = re.findall(r"\bLDG\.E(\S*)", sass)
  stg = re.findall(r"\bSTG\.E(\S*)", sass)
  wide = lambda ops: sum(".128" in o for o in ops)
  return Accesses(loads_128=wide(ldg), loads_narrow=len(ldg) - wide(ldg), stores_128=wide(stg),
                  stores_narrow=len(stg) - wide(stg))


def gpu_report(cases=None) -> list[dict]:
  """One row per (case, kernel, arch): the kernel's resources; raises on a compile error."""
  rows = []
  for case in cases or CASES:
    for kernel in triton_kernels(case):
      for arch in GPU_ARCHS:
        r = compile_triton(kernel, arch)
        rows.append(dict(case=case.name, kernel=kernel.name, arch=arch,
                         num_stages=kernel.num_stages, tile=kernel.tile_elems,
                         grid=kernel.grid, programs_per_sm=kernel.programs_per_sm,
                         per_thread=kernel.tile_elems // (32 * kernel.num_warps),
                         **dataclasses.asdict(r), blocks_per_sm=r.blocks_per_sm,
                         **dataclasses.asdict(memory_accesses(kernel, arch))))
  return rows


def gpu_markdown(rows: list[dict]) -> str:
  """The resource tables of ``gpu_report`` rows, one per architecture, as a Markdown page."""
  import triton  # pylint: disable=g-import-not-at-top

  spills = sum(r["local_bytes"] > 0 for r in rows)
  page = (
      "# GPU kernels: resources per compiled kernel\n\n"
      "Generated by `python tests/accel_check.py --gpu-report docs/gpu-resources.md` (no GPU "
      f"needed; jax {jax.__version__}, triton {triton.__version__}): every Pallas Triton kernel "
      "that the cases of `tests/accel_check.py` lower to for `cuda`, compiled by Triton for each "
      "architecture and read with `cuobjdump`. *tile*: elements of the kernel's largest tensor; "
      "*registers*, *spills*: per thread; *blocks/SM*: resident programs per SM allowed by "
      "registers (64K per SM, allocated per warp in units of 256) and warps (64 per SM); "
      "*LDG.128 / other*: global loads by width in the machine code (16 bytes per thread per "
      "instruction is the widest), *STG* the same for stores. The tile heuristics in "
      "`jax_normgrad/pallas/config.py` cite these tables. *grid*: programs launched; "
      "*per SM*: programs each of an H100's 132 SMs holds at once for the grid to be resident "
      "(the persistent kernels' plan; at most *blocks/SM*). "
      f"{len(rows)} (case, kernel, architecture) rows, {spills} with spills.\n")
  for arch in sorted({r["arch"] for r in rows}):
    page += f"\n## sm_{arch}\n\n" + _arch_table([r for r in rows if r["arch"] == arch])
  return page


def _arch_table(rows: list[dict]) -> str:
  head = ("| case | kernel | tile | elements / thread | warps | stages | registers "
          "| spills (bytes) | shared (bytes) | blocks/SM | grid | per SM | LDG.128 / other "
          "| STG.128 / other |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
  body = "".join(
      f"| {r['case']} | {r['kernel']} | {r['tile']} | {r['per_thread']} | {r['num_warps']} "
      f"| {r['num_stages']} | {r['registers']} "
      f"| {r['local_bytes']} | {r['shared_bytes']} | {r['blocks_per_sm']} | {r['grid']} "
      f"| {r['programs_per_sm']} "
      f"| {r['loads_128']} / {r['loads_narrow']} | {r['stores_128']} / {r['stores_narrow']} |\n"
      for r in rows)
  return head + body


# ----------------------------------------------------------------------------
# TPU: compile for topologies described without a TPU.


@functools.lru_cache(maxsize=None)
def tpu_device(generation: str):
  """The first device of a 4-chip topology of ``generation`` (no TPU needed)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[generation],
                                      platform="tpu").devices


def compile_tpu(case: Case, generation: str) -> str:
  """Compiles ``case`` for one chip of ``generation``; returns the optimized HLO text."""
  device = tpu_device(generation)[0]
  sharding = cases.single_device_sharding(device)
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in case.args]
  with _no_fallback():
    text = jax.jit(case.fn).lower(*args).compile().as_text()
  calls = text.count('custom_call_target="tpu_custom_call"')
  if calls < case.pallas:
    raise AssertionError(f"{case.name}: {calls} Mosaic calls on {generation}, "
                         f"expected >= {case.pallas}")
  return text


def compile_tpu_model_step(generation: str = "v5e", *, explicit: bool = True) -> str:
  """``norm_model``'s jitted training step over a 2x2 mesh of ``generation``'s 4-chip topology,
  compiled by libtpu; the optimized HLO text.

  Tokens (8, 128, 256) sharded over both mesh axes, images (8, 16, 16, 64) over
  all four chips, parameters replicated. ``explicit``: the mesh axes are
  Explicit (the ops run the kernels per shard, ``_sharding._shard_mapped``),
  and a FallbackWarning fails; else Auto.
  """
  import norm_model  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  mesh = Mesh(np.array(tpu_device(generation)).reshape(2, 2), ("data", "seq"),
              axis_types=(axis_type,) * 2)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, F32, sharding=NamedSharding(mesh, spec))
  shapes = jax.eval_shape(lambda: norm_model.params(256, 64))
  params = jax.tree.map(lambda a: sds(a.shape, P()), shapes)
  args = (params, sds((8, 128, 256), P("data", "seq")), sds((8, 16, 16, 64), P(("data", "seq"))))
  step = jax.jit(jax.value_and_grad(norm_model.loss, argnums=(0, 1, 2)))
  with _no_fallback() if explicit else contextlib.nullcontext(), jax.set_mesh(mesh):
    return step.lower(*args).compile().as_text()


def tools_missing() -> str | None:
  """Why the checks cannot run here (None when they can)."""
  try:
    import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return "the triton package is not installed (pip install '.[accel-check]')"
  if not (_tools_dir() / "cuobjdump").exists():
    return "triton ships no cuobjdump here"
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return "libtpu is not installed (pip install '.[accel-check]')"
  if jax.__version_info__[:2] != (0, 10):
    return (f"jax {jax.__version__}: from 0.11 the Pallas Triton lowering needs a GPU's kind; "
            f"the check runs under jax 0.10.x")
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    return "JAX_PLATFORMS=cpu resolves lax.platform_dependent for the CPU while tracing"
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gpu-report", type=pathlib.Path, help="write the GPU resource table")
  parser.add_argument("--skip-tpu", action="store_true")
  args = parser.parse_args(argv)
  missing = tools_missing()
  if missing:
    print(f"cannot run: {missing}", file=sys.stderr)
    return 2
  rows = gpu_report()
  spills = [r for r in rows if r["local_bytes"]]
  for r in spills:
    print(f"spills: {r['case']} {r['kernel']} sm_{r['arch']}: {r['local_bytes']} bytes, "
          f"{r['registers']} registers, {r['num_warps']} warps", file=sys.stderr)
  kernels = {(r["kernel"], r["arch"], r["registers"], r["num_warps"]) for r in rows}
  print(f"GPU: {len(rows)} (case, kernel, arch) compiled, {len(kernels)} distinct cubins, "
        f"{len(spills)} with spills, max {max(r['registers'] for r in rows)} registers")
  if args.gpu_report:
    args.gpu_report.write_text(gpu_markdown(rows))
  if not args.skip_tpu:
    for gen in TPU_TOPOLOGIES:
      for case in CASES:
        compile_tpu(case, gen)
    print(f"TPU: {len(CASES) * len(TPU_TOPOLOGIES)} compiled ({len(CASES)} cases x "
          f"{', '.join(TPU_TOPOLOGIES)})")
    calls = compile_tpu_model_step().count('custom_call_target="tpu_custom_call"')
    print(f"TPU: the explicitly sharded model step on v5e 2x2: {calls} Mosaic calls")
  return 1 if spills else 0


if __name__ == "__main__":
  sys.exit(main())
