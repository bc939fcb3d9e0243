"""Partitioned kernels on 8 CPU devices: sharded jit, shard_map and export (run in their own process).

JAX fixes the device count when it initialises, and the rest of the suite
runs on one device, so ``test_on_eight_devices`` runs this module again in a
child pytest with ``--xla_force_host_platform_device_count=8``; in the parent
process the 8-device tests are skipped.
"""

import contextlib
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cases

_CHILD = "JAX_NORMGRAD_SHARDING_CHILD"
IN_CHILD = os.environ.get(_CHILD) == "1"


def test_on_eight_devices():
  """Runs the 8-device tests below in a child process and requires them all to pass."""
  if IN_CHILD:
    pytest.skip("this is the child process")
  env = cases.child_env(**{_CHILD: "1"})
  flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["XLA_FLAGS"] = flags.strip()
  env["JAX_PLATFORMS"] = "cpu"  # the eight devices are CPU ones, on a GPU machine too
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                         __file__], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-3000:]
  # Every 8-device test must have run and passed: the only skips are this launcher
  # and, on jax >= 0.11 with no GPU, the shard_map exports for cuda (cases.export_for).
  reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", proc.stdout, re.M)
  assert "this is the child process" in reasons, proc.stdout[-3000:]
  allowed = {"this is the child process"} | ({cases.EXPORT_SKIP} if cases.TRITON_LOWERING_NEEDS_GPU_KIND
                                              else set())
  assert set(reasons) <= allowed, reasons


eight = pytest.mark.skipif(not IN_CHILD, reason="runs in the 8-device child process")

if IN_CHILD:
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_normgrad as jn
  from jax_normgrad.pallas import config
  from cases import export_for

  assert jax.device_count() == 8, jax.devices()
  F32 = jnp.float32

  def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))

  def _put(a, mesh, *spec):
    return jax.device_put(a, NamedSharding(mesh, P(*spec)))

  def _normal(i, shape):
    return jax.random.normal(jax.random.key(i), shape, F32)

  def _close(got, want, rtol=2e-5, atol=2e-4):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)

  def _hlo(f, *args):
    return f.lower(*args).compile().as_text()

  def _over_all_devices(line):
    """Whether an HLO all-reduce spans all 8 devices: ``replica_groups={{0,...,7}}``, or in
    the mesh form of newer HLO text ``replica_groups=mesh['a'=2,'b'=4] {'a','b'}`` (axes of
    all the devices: ``mesh['axis_0'=8,'axis_1'=1] {'axis_0'}`` too)."""
    if "replica_groups={{0,1,2,3,4,5,6,7}}" in line:
      return True
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if not m:
      return False
    sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    group = re.findall(r"'(\w+)'", m.group(2))
    return math.prod(sizes[a] for a in group) == math.prod(sizes.values()) == 8

  def _check_local(hlo, target, local_shape, *others):
    """No all-gather, and every ``target`` custom call reads a ``local_shape`` (or an ``others``)
    operand."""
    assert "all-gather" not in hlo
    calls = [l for l in hlo.splitlines() if f'custom_call_target="{target}"' in l]
    assert calls, f"no {target} call in the HLO"
    shapes = ["f32[" + ",".join(map(str, s)) + "]" for s in (local_shape,) + others]
    for line in calls:
      # operand_layout_constraints lists the operands' (local) shapes.
      operands = line.split("operand_layout_constraints=")[1].split("}, ")[0]
      assert any(s in operands for s in shapes), (shapes, line[:400])

  def _ref_ln(x, w, b, centered=True, eps=1e-5):
    m = x.mean(-1, keepdims=True) if centered else 0.0
    var = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / jnp.sqrt(var + eps) * w
    return y if b is None else y + b

  def _ln_loss(x, w, b):
    return jnp.sum(jn.layer_norm(x, w, b) ** 2 * jnp.cos(jnp.arange(x.shape[-1])))

  X = _normal(0, (16, 8, 64))
  W = 1.0 + 0.1 * _normal(1, (64,))
  B = 0.1 * _normal(2, (64,))


@eight
@pytest.mark.parametrize("mesh_shape,names,spec,explicit", [
    ((8,), ("d",), ("d",), False),            # batch of (B, S, H) over a 1-D mesh
    ((2, 4), ("a", "b"), ("a", "b"), False),  # B and S over the two axes of a 2x4 mesh
    ((2, 4), ("a", "b"), ("a", "b"), True),   # the same with explicit axes (make_mesh's default)
])
def test_layer_norm_training_step(mesh_shape, names, spec, explicit):
  mesh = jax.make_mesh(mesh_shape, names) if explicit else _mesh(mesh_shape, names)
  g = jax.jit(jax.grad(_ln_loss, argnums=(0, 1, 2)))
  args = (_put(X, mesh, *spec), _put(W, mesh), _put(B, mesh))
  got = g(*args)
  _close(got, g(X, W, B))
  assert got[0].sharding.spec[:len(spec)] == P(*spec)[:len(spec)]
  hlo = _hlo(g, *args)
  _check_local(hlo, "jax_normgrad_layer_norm_fwd", (16, 64))
  _check_local(hlo, "jax_normgrad_layer_norm_bwd", (16, 64))
  # One all-reduce of the parameter gradients, over every device (both mesh axes).
  reduces = [l for l in hlo.splitlines() if re.search(r"= \(?f32\[1,64\].* all-reduce\(", l)]
  assert reduces and all(_over_all_devices(l) for l in reduces), reduces


@eight
@pytest.mark.parametrize("op", ["layer_norm", "group_norm", "add_layer_norm"])
def test_xla_forward_with_the_backward_kernel(op):
  """``forward="xla"``: the jnp forward (no forward custom call) and the backward kernel, on
  each device's rows, with the single-device step's values."""
  mesh = _mesh((8,), ("d",))
  fns = {"layer_norm": lambda x, w, b: jn.layer_norm(x, w, b, forward="xla"),
         "group_norm": lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1, forward="xla"),
         "add_layer_norm": lambda x, w, b: jn.add_layer_norm(x, 2 * x, w, b, forward="xla")[0]}
  loss = lambda x, w, b: jnp.sum(fns[op](x, w, b) ** 2 * jnp.cos(jnp.arange(64)))
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  args = (_put(X, mesh, "d"), _put(W, mesh), _put(B, mesh))
  _close(g(*args), g(X, W, B))
  hlo = _hlo(g, *args)
  kind = "group" if op == "group_norm" else "layer"
  assert f"jax_normgrad_{kind}_norm_fwd" not in hlo
  _check_local(hlo, f"jax_normgrad_{kind}_norm_bwd", (2, 8, 64) if op == "group_norm" else (16, 64))


@eight
def test_rms_norm_training_step():
  mesh = _mesh((8,), ("d",))
  loss = lambda x, w: jnp.sum(jn.rms_norm(x, w) ** 2 * jnp.cos(jnp.arange(64)))
  g = jax.jit(jax.grad(loss, argnums=(0, 1)))
  args = (_put(X, mesh, "d"), _put(W, mesh))
  _close(g(*args), g(X, W))
  hlo = _hlo(g, *args)
  _check_local(hlo, "jax_normgrad_layer_norm_bwd", (16, 64))
  assert "all-reduce(" in hlo


@eight
@pytest.mark.parametrize("check_vma", [True, False])
def test_add_layer_norm_sharded_jit_and_shard_map(check_vma):
  """The residual form: rows sharded, the kernels on local rows, parameter gradients psum-ed."""
  mesh = _mesh((8,), ("d",))
  R = _normal(3, X.shape)

  def loss(x, r, w, b):
    y, h = jn.add_layer_norm(x, r, w, b)
    return jnp.sum(jnp.sin(y)) + jnp.sum(h * jnp.cos(jnp.arange(64)))

  def ref_loss(x, r, w, b):
    h = x + r
    return jnp.sum(jnp.sin(_ref_ln(h, w, b))) + jnp.sum(h * jnp.cos(jnp.arange(64)))

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  args = (_put(X, mesh, "d"), _put(R, mesh, "d"), _put(W, mesh), _put(B, mesh))
  want = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(X, R, W, B)
  _close(g(*args), want, atol=1e-3)
  hlo = _hlo(g, *args)
  _check_local(hlo, "jax_normgrad_layer_norm_fwd", (16, 64))
  _check_local(hlo, "jax_normgrad_layer_norm_bwd", (16, 64))
  # Under shard_map, against the jnp code's gradients there (without check_vma
  # neither psums the replicated parameters' gradients).
  got, want = (jax.jit(jax.shard_map(jax.grad(fn, argnums=(0, 1, 2, 3)), mesh=mesh,
                                     in_specs=(P("d"), P("d"), P(), P()),
                                     out_specs=(P("d"), P("d"), P(), P()), check_vma=check_vma))(
                                         X, R, W, B) for fn in (loss, ref_loss))
  _close(got, want, atol=1e-3)


@eight
@pytest.mark.parametrize("channel_axis,activation", [(1, None), (-1, None), (-1, "silu")])
def test_group_norm_batch_sharded(channel_axis, activation):
  mesh = _mesh((8,), ("d",))
  shape = (16, 32, 4, 4) if channel_axis == 1 else (16, 4, 4, 32)
  x = _normal(3, shape)
  w, b = 1.0 + 0.1 * _normal(4, (32,)), 0.1 * _normal(5, (32,))
  loss = lambda x, w, b: jnp.sum(jn.group_norm(x, 8, w, b, channel_axis=channel_axis,
                                               activation=activation) ** 3)
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  args = (_put(x, mesh, "d"), _put(w, mesh), _put(b, mesh))
  _close(g(*args), g(x, w, b), atol=1e-3)
  hlo = _hlo(g, *args)
  local = (2, 32, 16) if channel_axis == 1 else (2, 16, 32)
  _check_local(hlo, "jax_normgrad_group_norm_fwd", local)
  _check_local(hlo, "jax_normgrad_group_norm_bwd", local)
  if channel_axis == -1:  # channels-last: y's pass is a call of its own.
    _check_local(hlo, "jax_normgrad_group_norm_apply", local)


@eight
def test_backward_ops_called_directly():
  mesh = _mesh((8,), ("d",))
  dy = _normal(6, X.shape)
  _, mean, rstd = jn.layer_norm_fwd(X, 64, W, B)
  ln_bwd = jax.jit(lambda dy, x, m, r, w, b: jn.layer_norm_backward(dy, x, 64, m, r, w, b))
  args = (dy, X, mean, rstd, W, B)
  sharded = [_put(a, mesh, "d") for a in args[:4]] + [_put(W, mesh), _put(B, mesh)]
  _close(ln_bwd(*sharded), ln_bwd(*args))
  _check_local(_hlo(ln_bwd, *sharded), "jax_normgrad_layer_norm_bwd", (16, 64))
  # AscendC's LayerNormGradBeta: only parameter gradients, an empty rstd operand.
  beta = jax.jit(lambda dy, r: jn.layer_norm_grad_beta(dy, r))
  _close(beta(_put(dy, mesh, "d"), _put(X, mesh, "d")), beta(dy, X))
  _check_local(_hlo(beta, _put(dy, mesh, "d"), _put(X, mesh, "d")),
               "jax_normgrad_layer_norm_bwd", (16, 64))

  x = _normal(7, (16, 32, 16))
  gy = _normal(8, x.shape)
  gamma = 1.0 + 0.1 * _normal(9, (32,))
  _, gm, gr = jn.group_norm_fwd(x, gamma, None, 16, 32, 16, 4)
  gn_bwd = jax.jit(lambda dy, x, m, r, g: jn.group_norm_backward(dy, x, m, r, g, 16, 32, 16, 4))
  gargs = (gy, x, gm, gr, gamma)
  gsharded = [_put(a, mesh, "d") for a in gargs[:4]] + [_put(gamma, mesh)]
  _close(gn_bwd(*gsharded), gn_bwd(*gargs), atol=1e-3)
  hlo = _hlo(gn_bwd, *gsharded)
  _check_local(hlo, "jax_normgrad_group_norm_bwd", (2, 32, 16))
  assert "all-reduce(" in hlo


@eight
def test_normalized_dim_sharded_is_gathered_with_a_warning():
  mesh = _mesh((2, 4), ("a", "b"))
  g = jax.jit(jax.grad(_ln_loss, argnums=(0, 1, 2)))
  args = (_put(X, mesh, "a", None, "b"), _put(W, mesh), _put(B, mesh))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = g(*args)
  _close(got, g(X, W, B))
  assert any(issubclass(w.category, jn.ShardingWarning) for w in caught), caught


@eight
def test_vmap_and_jvp_under_a_mesh():
  """Batched weights (param_groups > 1) and forward mode run, unpartitioned, with sharded inputs."""
  mesh = _mesh((8,), ("d",))
  xs, ws = _normal(10, (8, 4, 64)), 1.0 + 0.1 * _normal(11, (8, 64))
  f = jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(jn.layer_norm(x, w) ** 2), argnums=1)))
  _close(f(_put(xs, mesh, "d"), _put(ws, mesh, "d")), f(xs, ws))
  h = jax.jit(lambda x, t: jax.jvp(lambda x: jn.layer_norm_fwd(x, 64, W)[0], (x,), (t,)))
  _close(h(_put(X, mesh, "d"), _put(X, mesh, "d")), h(X, X))


# ----------------------------------------------------------------------------
# Explicit mesh axes: the shardings are in the types, and the ops run the kernels per
# shard in shard_map themselves (_sharding._shard_mapped), on every backend.

if IN_CHILD:
  import norm_model
  import tolerances

  def _explicit_mesh(shape=(2, 4), names=("data", "seq")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))

  IMG = _normal(40, (8, 4, 4, 32))
  #: Every kernel of the model's step and the (local) operand shapes it may see:
  #: tokens (8, 16) over (2, 4) devices, 16 local rows; images 8 over 8, one sample (NHWC
  #: and NCHW).
  MODEL_KERNELS = {"jax_normgrad_layer_norm_fwd": [(16, 64)],
                   "jax_normgrad_layer_norm_bwd": [(16, 64)],
                   "jax_normgrad_group_norm_fwd": [(1, 16, 32), (1, 32, 16)],
                   "jax_normgrad_group_norm_apply": [(1, 16, 32)],
                   "jax_normgrad_group_norm_bwd": [(1, 16, 32), (1, 32, 16)]}

  def _assert_steps_equal(got, want):
    """Loss and gradients of a sharded step against the unsharded one's, in the tolerance table's
    terms: float32 sums over at most every element of x."""
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      assert g.shape == w.shape, path
      tolerances.assert_close(g, np.asarray(w, np.float64), F32, X.size, str(path))


@eight
def test_explicit_training_step_equals_the_unsharded_one():
  """A jitted training step with Explicit mesh axes: tokens sharded over both axes of a 2x4
  mesh, images over all eight devices, parameters replicated. Loss and every gradient equal
  the unsharded step's; each norm runs its CPU kernel on each device's local rows / samples
  (no all-gather); the parameter gradients all-reduced; every gradient keeps its primal's
  sharding type."""
  params = norm_model.params(64, 32)
  step = jax.jit(jax.value_and_grad(norm_model.loss, argnums=(0, 1, 2)))
  want = step(params, X, IMG)
  mesh = _explicit_mesh()
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, P()), jax.device_put(X, P("data", "seq")),
            jax.device_put(IMG, P(("data", "seq"))))
    with warnings.catch_warnings():
      warnings.simplefilter("error", jn.ShardingWarning)
      got = step(*args)
      hlo = _hlo(step, *args)
  _assert_steps_equal(got, want)
  for grad, arg in zip(jax.tree.leaves(got[1]), jax.tree.leaves(args)):
    assert jax.typeof(grad).sharding.spec == jax.typeof(arg).sharding.spec
  for target, shapes in MODEL_KERNELS.items():
    _check_local(hlo, target, *shapes)
  assert "all-reduce(" in hlo or "all-reduce-start(" in hlo


@eight
def test_explicit_vmap_and_second_order():
  """vmap over an explicitly sharded dim (per-example gradients: the mapped dim stays sharded)
  and grad of grad: the unsharded values."""
  mesh = _explicit_mesh()
  xs, ws = _normal(41, (8, 16, 64)), 1.0 + 0.1 * _normal(42, (8, 64))
  per_example = jax.jit(jax.vmap(jax.grad(
      lambda x, w: jnp.sum(jn.layer_norm(x, w) ** 2 * jnp.cos(jnp.arange(64))), argnums=(0, 1))))
  second = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(
      lambda x: jnp.sum(jn.rms_norm(x, W) ** 3))(x) ** 2)))
  want = per_example(xs, ws), second(X)
  with jax.set_mesh(mesh):
    got = (per_example(jax.device_put(xs, P("data", "seq")), jax.device_put(ws, P("data"))),
           second(jax.device_put(X, P("data", "seq"))))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    tolerances.assert_close(g, np.asarray(w, np.float64), F32, X.size)


@eight
@pytest.mark.parametrize("case", ["layer_norm", "group_norm_nhwc", "group_norm_nchw"])
def test_explicit_normalized_axis_sharded_is_gathered_with_a_warning(case):
  """A normalized axis sharded: LayerNorm's H; NHWC GroupNorm's H, merged with W into the
  spatial axis; NCHW GroupNorm's W, merged into H as the minor dim (a reshape that JAX refuses
  on a sharded dim). Gathered before the kernels, announced once, the unsharded values; the
  gradients keep their primals' sharding types."""
  mesh = _explicit_mesh()
  if case == "layer_norm":
    x, spec, loss = X, P("data", None, "seq"), _ln_loss
  else:
    nchw = case == "group_norm_nchw"
    x = jnp.moveaxis(IMG, -1, 1) if nchw else IMG
    spec = P("data", None, None, "seq") if nchw else P("data", "seq", None, None)
    loss = lambda x, w, b: jnp.sum(jn.group_norm(x, 8, w, b, channel_axis=1 if nchw else -1) ** 3)
  c = x.shape[-1] if case != "group_norm_nchw" else x.shape[1]
  args = (x, W[:c], B[:c])
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  want = g(*args)
  jn._sharding._warn_once.cache_clear()  # pylint: disable=protected-access
  with jax.set_mesh(mesh):
    sharded = (jax.device_put(x, spec), *jax.device_put(args[1:], P()))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = g(*sharded)
      hlo = _hlo(g, *sharded)
  messages = [str(w.message) for w in caught if issubclass(w.category, jn.ShardingWarning)]
  assert messages and all("re-sharded to replicated" in m for m in messages), messages
  for gr, w in zip(got, want):
    tolerances.assert_close(gr, np.asarray(w, np.float64), F32, x.size)
  for gr, a in zip(got, sharded):
    assert jax.typeof(gr).sharding.spec == jax.typeof(a).sharding.spec
  assert "all-gather" in hlo
  assert f"jax_normgrad_{case[:10]}_bwd" in hlo


@eight
def test_explicit_step_exported_for_tpu_runs_the_pallas_kernels():
  """The model's step with Explicit axes, exported for TPU from the CPU devices: every norm is
  the Pallas TPU kernel on local shapes, no fallback. With Auto axes the same step falls back
  to the reference on TPU, and the warning names both ways to the kernels."""
  from jax_normgrad import _fallback
  params = norm_model.params(64, 32)
  step = jax.jit(jax.value_and_grad(norm_model.loss, argnums=(0, 1, 2)))
  texts = {}
  for axis_type in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(axis_type,) * 2)
    sds = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                               sharding=NamedSharding(mesh, spec))
    args = (jax.tree.map(lambda a: sds(a, P()), params), sds(X, P("data", "seq")),
            sds(IMG, P(("data", "seq"))))
    _fallback.warn_once.cache_clear()
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      texts[axis_type] = jax.export.export(step, platforms=["tpu"])(*args).mlir_module()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, jn.FallbackWarning)]
    if axis_type == AxisType.Explicit:
      assert not fallbacks, fallbacks
    else:
      assert fallbacks and all("Explicit" in m and "jax.shard_map" in m for m in fallbacks)
  explicit, auto = texts[AxisType.Explicit], texts[AxisType.Auto]
  assert "jax_normgrad_norm_fwd" in explicit and "jax_normgrad_norm_bwd" in explicit
  assert "tpu_custom_call" in explicit and "all_gather" not in explicit
  assert "tpu_custom_call" not in auto


@eight
def test_explicit_step_exported_for_cuda_runs_the_triton_kernels():
  """The model's step with Explicit axes exported for CUDA: the Triton kernels, no fallback,
  no all-gather (the same shard_map as on every backend)."""
  params = norm_model.params(64, 32)
  step = jax.jit(jax.value_and_grad(norm_model.loss, argnums=(0, 1, 2)))
  mesh = _explicit_mesh()
  sds = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  args = (jax.tree.map(lambda a: sds(a, P()), params), sds(X, P("data", "seq")),
          sds(IMG, P(("data", "seq"))))
  triton = "__gpu$xla.gpu.triton"
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    text = export_for("cuda", step, args, mesh=mesh,
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
                      ).mlir_module()
  assert triton in text and "jax_normgrad_norm_bwd" in text and "all_gather" not in text


#: The implementations the shard_map tests run: the CPU kernels, and the Pallas
#: kernels of GPU ("pallas": Triton's) and TPU ("mosaic_tpu"), interpreted.
IMPLEMENTATIONS = ["ffi", "pallas", "mosaic_tpu"]


@contextlib.contextmanager
def _implementation(name):
  """The implementation of one of IMPLEMENTATIONS (a context, for the tests' ``with``)."""
  yield name


@eight
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_shard_map_grad_matches_jnp_layer(kind, impl, check_vma):
  """x sharded, parameters replicated: grad is the jnp layer's (the weight gradient psum-ed).

  Every kernel set (the CPU kernels; the GPU and TPU Pallas kernels,
  interpreted), with shard_map's varying-axes check on and off.
  """
  with _implementation(impl) as implementation:
    _shard_map_grad_matches_jnp_layer(kind, implementation, check_vma)


def _shard_map_grad_matches_jnp_layer(kind, implementation, check_vma):
  mesh = _mesh((8,), ("d",))
  if kind == "group_norm":
    x = _normal(12, (16, 32, 4))
    w, b = 1.0 + 0.1 * _normal(13, (32,)), 0.1 * _normal(14, (32,))

    def ref(x, w, b):
      g = x.reshape(x.shape[0], 8, -1)
      m = g.mean(-1, keepdims=True)
      y = ((g - m) / jnp.sqrt(((g - m) ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(x.shape)
      return y * w[:, None] + b[:, None]

    layers = {"jn": lambda x, w, b: jn.group_norm(x, 8, w, b, implementation=implementation),
              "jnp": ref}
  else:
    x, w, b = X, W, B
    centered = kind == "layer_norm"
    layers = {"jn": (lambda x, w, b: jn.layer_norm(x, w, b, implementation=implementation))
                    if centered else
                    (lambda x, w, b: jn.rms_norm(x, w, eps=1e-5, implementation=implementation) + b),
              "jnp": lambda x, w, b: _ref_ln(x, w, b, centered)}
  results = {}
  for name, layer in layers.items():
    local = lambda x, w, b: jax.grad(lambda *a: jnp.sum(jnp.sin(layer(*a))),
                                     argnums=(0, 1, 2))(x, w, b)
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P()),
                              out_specs=(P("d"), P(), P()), check_vma=check_vma))
    results[name] = f(x, w, b)
  _close(results["jn"], results["jnp"], atol=1e-3)


@eight
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_shard_map_training_step_of_the_issue(impl):
  """The multi-device issue's example: a (2, 4) mesh, x over both axes, psum-ed loss."""
  mesh = _mesh((2, 4), ("data", "seq"))
  with _implementation(impl) as implementation:
    f = jax.shard_map(
        lambda x, w, b: jax.lax.psum(
            jnp.sum(jn.layer_norm(x, w, b, implementation=implementation) ** 2), ("data", "seq")),
        mesh=mesh, in_specs=(P("data", "seq", None), P(), P()), out_specs=P())
    got = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(X, W, B)
  want = jax.grad(lambda x, w, b: jnp.sum(_ref_ln(x, w, b) ** 2), argnums=(0, 1, 2))(X, W, B)
  _close(got, want, atol=1e-3)


def _every_op(implementation):
  """``f(x, dy, w, b) -> outputs`` of every public op and layer, on local shapes."""
  impl = dict(implementation=implementation)
  eps = 1e-5

  def ops(x, dy, w, b):
    h = x.shape[-1]
    y, mean, rstd = jn.layer_norm_fwd(x, h, w, b, eps, **impl)
    outs = [y, mean, rstd]
    outs += jn.layer_norm_backward(dy, x, h, mean, rstd, w, b, **impl)
    outs += jn.layer_norm_backward(dy, x, h, mean, rstd, w, b, output_mask=(False, True, False),
                                   **impl)[1:2]
    yr, rr = jn.rms_norm_fwd(x, h, w, eps, **impl)
    outs += [yr, rr] + list(jn.rms_norm_backward(dy, x, h, rr, w, **impl))
    var = 1.0 / rstd ** 2 - eps
    pd_x, res = jn.layer_norm_grad(dy, x, var, mean, w, eps, **impl)
    outs += [pd_x, res] + list(jn.layer_norm_grad_beta(dy, res, h, **impl))
    outs += jn.layer_norm_backward_from_normalized(dy, w, res, 1.0 / rstd, **impl)
    n, c, s = x.shape[0], 16, x.shape[1] * h // 16
    gx, gdy = x.reshape(n, c, s), dy.reshape(n, c, s)
    for channels_last in (False, True):
      gy, gm, gr = jn.group_norm_fwd(gx, w[:c], b[:c], n, c, s, 4, eps,
                                     channels_last=channels_last, **impl)
      outs += [gy, gm, gr] + list(jn.group_norm_backward(
          gdy, gx, gm, gr, w[:c], n, c, s, 4, channels_last=channels_last, **impl))
    layer = lambda x, w, b: jnp.sum(jnp.sin(jn.layer_norm(x, w, b, save="normalized", **impl)))
    outs += jax.grad(layer, argnums=(0, 1, 2))(x, w, b)
    return [o for o in outs if o is not None]

  return ops


@eight
@pytest.mark.parametrize("impl", ["pallas", "mosaic_tpu"])
def test_shard_map_every_op_pallas_equals_ffi(impl):
  """Each op inside shard_map (x, dy sharded; parameters replicated), checked for types:
  the Pallas kernels give the CPU kernels' results. Per-device outputs are
  stacked (a parameter gradient: one local partial per device)."""
  mesh = _mesh((8,), ("d",))
  dy = _normal(15, X.shape)

  def run(implementation):
    ops = _every_op(implementation)
    n_out = len(jax.eval_shape(ops, X[:2], dy[:2], W, B))
    f = jax.shard_map(lambda *a: [o[None] for o in ops(*a)], mesh=mesh,
                      in_specs=(P("d"), P("d"), P(), P()), out_specs=[P("d")] * n_out)
    return jax.jit(f)(X, dy, W, B)

  want = run("ffi")
  with _implementation(impl) as implementation:
    got = run(implementation)
  assert len(got) == len(want) > 30
  _close(got, want, atol=1e-3)


@eight
@pytest.mark.parametrize("impl", ["pallas", "mosaic_tpu"])
def test_sharded_jit_runs_the_pallas_kernels_partitioned(impl):
  """The partitioning rule with the Pallas kernels (interpreted): local rows, one all-reduce."""
  mesh = _mesh((8,), ("d",))
  with _implementation(impl) as implementation:
    loss = lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b, implementation=implementation) ** 2
                                   * jnp.cos(jnp.arange(64)))
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = (_put(X, mesh, "d"), _put(W, mesh), _put(B, mesh))
    got = g(*args)
    hlo = _hlo(g, *args)
  _close(got, jax.grad(lambda x, w, b: jnp.sum(_ref_ln(x, w, b) ** 2 * jnp.cos(jnp.arange(64))),
                       argnums=(0, 1, 2))(X, W, B), atol=1e-3)
  assert "all-gather" not in hlo and "all-reduce(" in hlo


@eight
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_export_of_the_shard_map_step_for_accelerators(platform, check_vma):
  """The README's multi-device export recipe lowers the accelerator kernels on an 8-device mesh."""
  mesh = _mesh((2, 4), ("data", "seq"))
  local = jax.grad(_ln_loss, argnums=(0, 1, 2))
  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data", "seq"), P(), P()),
                            out_specs=(P("data", "seq"), P(), P()), check_vma=check_vma))
  triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    exported = export_for(platform, f, (X, W, B), mesh=mesh,
                          disabled_checks=jn.export_safety_checks() + [triton])
  text = exported.mlir_module()
  assert exported.nr_devices == 8
  assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text
  assert "jax_normgrad_norm_bwd" in text and "custom_call @jax_normgrad_" not in text
  assert "all_gather" not in text
  # The replicated parameters' gradients: psum-ed under check_vma=True; with
  # check_vma=False shard_map leaves that to the user, as for a jnp layer.
  assert ("all_reduce" in text) == check_vma


@eight
def test_export_round_trip():
  f = jax.jit(jax.grad(_ln_loss, argnums=(0, 1, 2)))
  checks = jn.export_safety_checks()
  assert len(checks) == len(jn._ffi.TARGETS) == 5
  exported = jax.export.export(f, disabled_checks=checks)(X, W, B)
  text = exported.mlir_module()
  assert "jax_normgrad_layer_norm_fwd" in text and "jax_normgrad_layer_norm_bwd" in text
  restored = jax.export.deserialize(exported.serialize())
  _close(restored.call(X, W, B), f(X, W, B), rtol=0, atol=0)
  with pytest.raises(ValueError, match="custom_call"):
    jax.export.export(f)(X, W, B)


@eight
def test_export_round_trip_of_a_sharded_shard_map_step():
  """The multi-device export recipe: shard_map (the kernels on local shapes) serializes."""
  mesh = _mesh((8,), ("d",))
  sx, sr = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
  local = jax.grad(_ln_loss, argnums=(0, 1, 2))
  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P()),
                            out_specs=(P("d"), P(), P())), in_shardings=(sx, sr, sr))
  exported = jax.export.export(f, disabled_checks=jn.export_safety_checks())(X, W, B)
  restored = jax.export.deserialize(exported.serialize())
  args = (jax.device_put(X, sx), jax.device_put(W, sr), jax.device_put(B, sr))
  _close(restored.call(*args), jax.jit(jax.grad(_ln_loss, argnums=(0, 1, 2)))(X, W, B))


# ----------------------------------------------------------------------------
# The rewrite (jax_normgrad.rewrite) under sharded jit and into shard_map bodies.


@eight
@pytest.mark.parametrize("where", ["sharded jit", "shard_map"])
def test_rewrite_of_a_sharded_step(where):
  """A jnp LayerNorm's step under ``rewrite``: the kernels in the step (under sharded jit, the
  partitioned op; inside a ``shard_map`` body, rewritten in place), values and gradients as
  the jnp step's."""
  mesh = _mesh((8,), ("d",))
  x, w, b = _put(X, mesh, "d"), W, B
  if where == "shard_map":
    body = jax.shard_map(_ref_ln, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P("d"))
  else:
    body = _ref_ln
  loss = lambda x, w, b: jnp.sum(body(x, w, b) ** 2 * jnp.cos(jnp.arange(64)))
  step = jax.jit(jax.value_and_grad(jn.rewrite(loss), argnums=(0, 1, 2)))
  report = jn.explain_rewrite(loss, x, w, b)
  assert len(report.matches) == 1 and not report.near_misses, report
  text = _hlo(step, x, w, b)  # compiled: the partitioned op's kernels are placed then
  assert "jax_normgrad_layer_norm_fwd" in text and "jax_normgrad_layer_norm_bwd" in text
  with jax.set_mesh(mesh):
    got = step(x, w, b)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, b)
  _close(got, want)


@eight
def test_explain_on_tpu_knows_a_multi_device_jit():
  """``explain`` for a TPU, as the lowering decides: in a jit over 8 devices (Auto axes: XLA
  partitions the op, which it cannot do to a Pallas TPU kernel) the reference, with the reason;
  inside ``shard_map`` and on one device, the kernels."""
  mesh = _mesh((8,), ("d",))
  x = _put(X, mesh, "d")
  loss = lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b) ** 2)
  explained = jn.explain(jax.grad(loss), x, W, B, platform="tpu")
  assert [e.choice.implementation for e in explained] == ["xla", "xla"], str(explained)
  assert "multi-device jit" in str(explained)
  # The shardings of a nested jit alone, on arguments of one device.
  sharded = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P("d")), None, None))
  assert {e.choice.implementation for e in jn.explain(sharded, X, W, B, platform="tpu")} == {"xla"}
  body = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P("d"))
  for fn, args in ((body, (x, W, B)), (jax.grad(loss), (X, W, B))):
    assert {e.choice.implementation for e in jn.explain(fn, *args, platform="tpu")} == {
        "mosaic_tpu"}
