"""jax_normgrad.rewrite on hand-written norms: every form found, values and gradients within tolerance, negatives unchanged.

The forms are tests/rewrite_corpus.py's. Each check compares the rewritten
function with the original one evaluated in float32 (x up-cast: the same
math), counts the kernels in the lowered text, and for the negatives asserts
the jaxpr is the original's.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import rewrite_corpus as rc
from tolerances import ATOL32, RTOL, assert_close

F32, BF16 = jnp.float32, jnp.bfloat16


def kernels_in(text, kind="fwd"):
  """The CPU kernels' custom calls of ``kind`` in a lowered program's text."""
  return sum(text.count(f"custom_call @jax_normgrad_{op}_{kind}") for op in ("layer_norm", "group_norm"))


def kernel_calls(fn, *args, kind="fwd"):
  """The CPU kernels' custom calls of ``kind`` in ``jit(fn)``'s lowered text."""
  return kernels_in(jax.jit(fn).lower(*args).as_text(), kind)


def _reduced(form, x):
  return 40 if form.group else x.shape[-1]


def _check(form, dtype):
  x, w, b, ct = rc.inputs(form.group, dtype)
  new = jn.rewrite(form.fn)

  def loss(f):
    return lambda x, w, b: jnp.sum(f(x, w, b).astype(F32) * ct)

  y_ref, g_ref = jax.jit(lambda *a: (form.fn(*a), jax.grad(loss(form.fn), (0, 1, 2))(*a)))(
      x.astype(F32), w, b)
  y, g = jax.jit(lambda *a: (new(*a), jax.grad(loss(new), (0, 1, 2))(*a)))(x, w, b)
  out_dtype = BF16 if dtype == BF16 else F32
  n = _reduced(form, x)
  # A bfloat16 program rounds where it computes in bfloat16 (the mean, xhat), and the rewrite
  # keeps its dtypes: in bfloat16 an error of a few roundings of the largest value is allowed.
  unit = RTOL[jnp.dtype(BF16)] * 4 / (ATOL32 * np.sqrt(n)) if dtype == BF16 else 1.0
  assert_close(y, y_ref, out_dtype, n, "y", scale=float(np.abs(np.asarray(y_ref, np.float32)).max()) * unit)
  scale = float(np.abs(np.asarray(ct)).max() * np.abs(np.asarray(w)).max() * 2) * unit
  assert_close(g[0], g_ref[0], out_dtype, n, "dx", scale=scale)
  rows = x.size // n
  for i, name in ((1, "dw"), (2, "db")):
    assert_close(g[i], g_ref[i], out_dtype, rows * n, name, scale=scale * np.sqrt(rows))
  return x, w, b, new


@pytest.mark.parametrize("name", sorted(rc.FORMS))
def test_form_float32(name):
  form = rc.FORMS[name]
  x, w, b, new = _check(form, F32)
  report = jn.explain_rewrite(form.fn, x, w, b)
  assert len(report.matches) == form.norms, str(report)
  assert sorted(m.op for m in report.matches) == sorted(form.op.split("+")), str(report)
  grad = jax.grad(lambda x, w, b: jnp.sum(new(x, w, b)), (0, 1, 2))
  assert kernel_calls(grad, x, w, b, kind="bwd") == form.norms


@pytest.mark.parametrize("name", ["ln_two_pass", "ln_bf16_math", "rms_llama", "rms_gemma",
                                  "rms_maxtext", "gn_nhwc_silu", "ln_residual"])
def test_form_bfloat16(name):
  form = rc.FORMS[name]
  x, w, b, new = _check(form, BF16)
  assert kernel_calls(new, x, w, b) >= form.norms


def test_report_names_op_eps_activation_and_source():
  x, w, b, _ = rc.inputs(True, F32)
  report = jn.explain_rewrite(rc.gn_nhwc_silu, x, w, b)
  (m,) = report.matches
  assert (m.op, m.activation, m.shape, m.dtype) == ("group_norm", "silu", (2, 3, 5, 16), "float32")
  assert m.eps == pytest.approx(rc.EPS, rel=1e-6)
  assert "rewrite_corpus.py" in m.source
  text = str(report)
  assert "group_norm" in text and "activation=silu" in text
  x, w, b, _ = rc.inputs(False, F32)
  (m,) = jn.explain_rewrite(rc.ln_residual, x, w, b).matches
  assert m.op == "add_layer_norm"
  (m,) = jn.explain_rewrite(rc.rms_gemma, x, w, b).matches
  assert m.op == "rms_norm" and m.weight != "-"


@pytest.mark.parametrize("name", sorted(rc.NEGATIVES))
def test_negative_left_alone(name):
  f = rc.NEGATIVES[name]
  x, w, b, _ = rc.inputs(False, F32)
  w = jnp.ones(x.shape[-1]) if name != "batch_axis_stats" else jnp.ones(x.shape[-1])
  before = str(jax.make_jaxpr(f)(x, w, b))
  after = str(jax.make_jaxpr(jn.rewrite(f))(x, w, b))
  assert after == before
  assert not jn.explain_rewrite(f, x, w, b).matches


def test_near_misses_say_why():
  x, w, b, _ = rc.inputs(False, F32)
  report = jn.explain_rewrite(rc.eps_outside_sqrt, x, w, b)
  assert report.near_misses and "1/sqrt(var + eps)" in report.near_misses[0].reason
  report = jn.explain_rewrite(rc.batch_axis_stats, x, w, b)
  assert report.near_misses and "trailing" in report.near_misses[0].reason
  report = jn.explain_rewrite(rc.l2_normalize, x, w, b)
  assert any("L2" in m.reason for m in report.near_misses)


def test_a_norm_over_the_leading_axis_is_left_alone_and_reported():
  """Named-axis code's RMSNorm over axis 0 (the normalized axis first, as penzai's jaxprs have
  it): left alone, since the op on a moved view does not pay on the CPU (docs/rewrite.md, "What
  it leaves alone"), and the report names the axes."""
  def leading(x, w):
    ms = jnp.mean(jnp.square(x), axis=0, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * w[:, None]

  x, w = jnp.ones((48, 10)) * jnp.arange(10.0), jnp.linspace(0.5, 1.5, 48)
  report = jn.explain_rewrite(leading, x, w)
  assert not report.matches
  assert any("axes (0,)" in m.reason and "moved view" in m.reason for m in report.near_misses), report
  assert str(jax.make_jaxpr(jn.rewrite(leading))(x, w)) == str(jax.make_jaxpr(leading)(x, w))


# ----------------------------------------------------------------------------
# Nested jaxprs and transformations.


def _block(h, w, b):
  return jnp.tanh(rc.ln_two_pass(h, w, b))


def test_inside_scan_remat_cond_and_jit():
  x, w, b, _ = rc.inputs(False, F32)

  def model(x, w, b):
    def body(h, _):
      h = jax.checkpoint(_block)(h, w, b)
      h = jax.lax.cond(True, lambda h: rc.rms_llama(h, w, b), lambda h: h, h)
      return jax.jit(rc.ln_folded)(h, w, b), None
    return jax.lax.scan(body, x, None, length=3)[0]

  new = jn.rewrite(model)
  jaxpr = str(jax.make_jaxpr(new)(x, w, b))
  assert "scan" in jaxpr and "checkpoint" in jaxpr or "remat" in jaxpr
  report = jn.explain_rewrite(model, x, w, b)
  # One scan body: the checkpointed LayerNorm, both cond branches' (one RMSNorm), the jit's.
  assert report.counts() == {"layer_norm": 2, "rms_norm": 1}, str(report)
  loss = lambda f: lambda x, w, b: jnp.sum(f(x, w, b) ** 2)
  got = jax.jit(jax.value_and_grad(loss(new), (0, 1, 2)))(x, w, b)
  want = jax.jit(jax.value_and_grad(loss(model), (0, 1, 2)))(x, w, b)
  for a, e, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("loss", "dx", "dw", "db")):
    assert_close(a, e, F32, x.size, name, scale=float(np.abs(e).max()) * 4)
  assert kernel_calls(jax.grad(loss(new)), x, w, b, kind="bwd") == 3


def test_vmap_both_ways_and_custom_jvp():
  x, w, b, _ = rc.inputs(False, F32)
  xs = jnp.stack([x, 2 * x])
  want = jax.vmap(rc.ln_two_pass, (0, None, None))(xs, w, b)
  for f in (jax.vmap(jn.rewrite(rc.ln_two_pass), (0, None, None)),
            jn.rewrite(jax.vmap(rc.ln_two_pass, (0, None, None)))):
    assert_close(jax.jit(f)(xs, w, b), want, F32, x.shape[-1], "y")
    assert kernel_calls(f, xs, w, b) == 1

  @jax.custom_jvp
  def norm(x):
    return rc.ln_two_pass(x, w, b)
  norm.defjvp(lambda p, t: jax.jvp(lambda x: rc.ln_two_pass(x, w, b), p, t))
  assert jn.explain_rewrite(norm, x).counts() == {"layer_norm": 1}


def test_applied_to_a_gradient_rewrites_the_forward_only():
  x, w, b, _ = rc.inputs(False, F32)
  g = jax.grad(lambda x: jnp.sum(rc.ln_two_pass(x, w, b) ** 2))
  assert_close(jax.jit(jn.rewrite(g))(x), jax.jit(g)(x), F32, x.shape[-1], "dx",
               scale=float(np.abs(np.asarray(jax.jit(g)(x))).max()) * 4)


def test_static_arguments_and_pytrees():
  x, w, b, _ = rc.inputs(False, F32)

  def f(params, x, *, eps=1e-5, centre=True):
    m = x.mean(-1, keepdims=True) if centre else 0.0
    return (x - m) * jax.lax.rsqrt(x.var(-1, keepdims=True) + eps) * params["w"] + params["b"]

  new = jn.rewrite(f)
  y = new({"w": w, "b": b}, x, eps=1e-3)
  assert_close(y, f({"w": w, "b": b}, x, eps=1e-3), F32, x.shape[-1], "y")
  report = jn.explain_rewrite(f, {"w": w, "b": b}, x, eps=1e-3)
  assert len(report.matches) == 1, str(report)
  (m,) = report.matches
  assert m.eps == pytest.approx(1e-3, rel=1e-6)
  with pytest.raises(TypeError, match="fun"):
    jn.rewrite(3)
  with pytest.raises(TypeError, match="report"):
    jn.rewrite(f, report="yes")


def test_report_callback_and_print(capsys):
  x, w, b, _ = rc.inputs(False, F32)
  got = []
  jn.rewrite(rc.ln_two_pass, report=got.append)(x, w, b)
  assert isinstance(got[0], jn.RewriteReport) and got[0].counts() == {"layer_norm": 1}
  jn.rewrite(rc.ln_two_pass, report=True)(x, w, b)
  assert "1 norm(s) rewritten" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# Planning: one jitted function called after several norms, a cyclic plan.


def test_shared_jitted_activation_after_each_norm():
  """A UNet's blocks: ``jax.nn.silu`` (one jaxpr, jitted) after each GroupNorm, each block's input the last one's result.

  The inlined calls share the body's variables; each must stay its own value
  (else the second norm's SiLU reads as the first's, and the plan reads a
  result before it is computed).
  """
  x, w, b, _ = rc.inputs(True, F32)
  k = jax.random.normal(jax.random.key(3), (16, 16), F32) * 0.3

  def unet(x, w, b):
    h = rc.gn_nhwc_silu(x, w, b) @ k
    h = rc.gn_nhwc_silu(h + x, w, b) @ k
    return rc.gn_nhwc_silu(h + x, w, b)

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    report = jn.explain_rewrite(unet, x, w, b)
    new = jn.rewrite(unet)
    assert_close(jax.jit(new)(x, w, b), jax.jit(unet)(x, w, b), F32, 40, "y")
    assert kernel_calls(new, x, w, b) == 3
  assert [m.activation for m in report.matches] == ["silu"] * 3, str(report)


def test_a_cyclic_plan_is_announced_and_runs_as_written(monkeypatch):
  # The planner's safety net, on a plan the matcher never makes: the first norm made to read
  # the second's result (a test may reach into the package's modules to build it).
  from jax_normgrad._rewrite import _transform
  find = _transform._identify.find

  def bad_find(g):
    matches, misses = find(g)
    if len(matches) == 2:
      (second_y,) = matches[1].outputs
      matches[0].x = second_y
    return matches, misses

  monkeypatch.setattr(_transform._identify, "find", bad_find)
  x, w, b, _ = rc.inputs(False, F32)
  new = jn.rewrite(rc.two_norms)
  with pytest.warns(RuntimeWarning, match="would read their own results"):
    y = new(x, w, b)
  assert_close(y, rc.two_norms(x, w, b), F32, x.shape[-1], "y")
  with pytest.warns(RuntimeWarning):
    assert kernel_calls(new, x, w, b) == 0


def test_matching_reads_each_norms_region_only():
  """A candidate's interpretation reads the equations computed from its root up to its norm's
  end, not the rest of the graph: the matching's cost is linear in the norms (a deep model's
  norms times its equations, before)."""
  from jax_normgrad._rewrite import _identify
  from jax_normgrad._rewrite._graph import Graph

  class Counted(list):
    reads = 0

    def __getitem__(self, i):
      Counted.reads += 1
      return super().__getitem__(i)

  def reads(depth):
    x, w, b, _ = rc.inputs(False, F32)

    def f(x, w, b):
      for _ in range(depth):
        x = x + jnp.tanh(rc.ln_two_pass(x, w, b))
      return x

    closed = jax.make_jaxpr(f)(x, w, b)
    g = Graph(closed.jaxpr, closed.consts)
    g.eqns = Counted(g.eqns)
    Counted.reads = 0
    matches, _ = _identify.find(g)
    assert len(matches) == depth
    return Counted.reads / len(g.eqns)

  # Reads per equation stay flat as the model deepens (were about depth / 2).
  assert reads(48) < 1.5 * reads(12) and reads(48) < 8
