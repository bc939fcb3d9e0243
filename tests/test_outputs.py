"""The primitives' outputs by name (``jax_normgrad._outputs``): the abstract evaluation, the
reference and the partitioning rule agree with the names, for every set of outputs."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from jax_normgrad import _outputs
from jax_normgrad._operands import GroupNormBwd, NormBwd, NormFwd, pack
from jax_normgrad._outputs import GroupNormBwdOut, NormBwdOut, NormFwdOut
from jax_normgrad.primitives import group_norm as gn_prim
from jax_normgrad.primitives import layer_norm as ln_prim

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
M, H, W = 6, 16, 2


def _avals(outs):
  return [(tuple(o.shape), jnp.dtype(o.dtype)) for o in outs]


def _check(prim, xla, roles, cls, ops, names, types, **params):
  """The primitive's abstract results, the reference's and the roles' count follow ``names``."""
  args, operands = pack(ops)
  want = [(tuple(t.shape), jnp.dtype(t.dtype)) for t in _outputs.pack(types, names)]
  assert set(names) <= set(cls._fields) and list(names) == sorted(names, key=cls._fields.index)
  assert _avals(jax.eval_shape(lambda *a: prim.bind(*a, operands=operands, implementation="xla",
                                                    **params), *args)) == want
  assert _avals(jax.eval_shape(lambda *a: xla(*a, operands=operands, **params),
                               *args)) == want
  assert len(roles(operands=operands, implementation="xla", **params)[1]) == len(names)


@pytest.mark.parametrize("mask,write_xhat,dx_dy", [
    (m, xh, d) for m, xh, d in itertools.product(
        [(True, True, True), (True, False), (False, True), (False, False, True), (True, False, True)],
        [False, True], [False, True]) if m[0] or not d])
def test_layer_norm_bwd_outputs(mask, write_xhat, dx_dy):
  x = S((M, H), F32)
  dy = S((M, H), BF16 if dx_dy else F32)
  ops = NormBwd(dy, x, S((M,), F32), S((M,), F32), S((W, H), F32))
  names = _outputs.norm_bwd_names(output_mask=mask, write_xhat=write_xhat, write_dx_dy=dx_dy)
  full = _outputs.output_mask(mask)
  assert names == tuple(n for n, on in zip(NormBwdOut._fields,
                                           (full[0], dx_dy, full[1], full[2], write_xhat)) if on)
  _check(ln_prim.layer_norm_bwd_p, ln_prim._bwd_xla, ln_prim._bwd_roles, NormBwdOut, ops, names,
         _outputs.norm_bwd_types(ops, param_groups=W), centered=True, output_mask=mask,
         param_groups=W, normalized=False, write_xhat=write_xhat, write_dx_dy=dx_dy)


@pytest.mark.parametrize("centered,write_xhat,residual", [
    (c, xh, r) for c, xh, r in itertools.product([True, False], repeat=3) if not (xh and r)])
def test_layer_norm_fwd_outputs(centered, write_xhat, residual):
  x = S((M, H), BF16)
  ops = NormFwd(x, S((M, H), F32) if residual else None, S((W, H), F32))
  params = dict(eps=1e-5, centered=centered, param_groups=W, write_xhat=write_xhat,
                y_dtype=F32, h_dtype=F32 if residual else None)
  names = _outputs.norm_fwd_names(operands=pack(ops)[1], **params)
  assert names == tuple(n for n, on in zip(NormFwdOut._fields,
                                           (True, centered, True, write_xhat, residual)) if on)
  _check(ln_prim.layer_norm_fwd_p, ln_prim._fwd_xla, ln_prim._fwd_roles, NormFwdOut, ops, names,
         _outputs.norm_fwd_types(ops, **params), **params)


@pytest.mark.parametrize("mask", [m for m in itertools.product([True, False], repeat=3) if any(m)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_bwd_outputs(mask, channels_last):
  x = S((4, 3, 8) if channels_last else (4, 8, 3), F32)
  ops = GroupNormBwd(x, x, S((4, 2), F32), S((4, 2), F32), S((W, 8), F32))
  names = _outputs.group_norm_bwd_names(output_mask=mask)
  assert names == tuple(n for n, on in zip(GroupNormBwdOut._fields, mask) if on)
  _check(gn_prim.group_norm_bwd_p, gn_prim._bwd_xla, gn_prim._bwd_roles, GroupNormBwdOut, ops,
         names, _outputs.group_norm_bwd_types(ops, channels_last=channels_last, param_groups=W),
         group=2, channels_last=channels_last, activation=None, output_mask=mask,
         param_groups=W)


def test_slots_and_unpack():
  types = NormBwdOut(*[S((2,), F32)] * 5)
  got = _outputs.slots(types, ("dx", "xhat"), ("dx", "dweight", "dbias", "xhat", "dx_dy"))
  assert [t.shape for t in got] == [(2,), (0,), (0,), (2,), (0,)]
  assert _outputs.unpack(NormBwdOut, [1, 2], ("dx", "dbias")) == NormBwdOut(dx=1, dbias=2)
  with pytest.raises(ValueError, match="NormBwdOut"):
    _outputs.unpack(NormBwdOut, [1], ("dx", "dbias"))
  assert _outputs.output_mask((True, False)) == (True, False, False)
