"""A jaxpr transformation that finds LayerNorm, RMSNorm and GroupNorm in any JAX function and runs them on this package's ops.

Above the public ops: it calls them, and nothing below knows it exists.
``_graph`` (the flattened jaxpr), ``_algebra`` (row statistics and
polynomials in x), ``_match`` (the abstract interpretation), ``_identify``
(matches and near misses), ``_transform`` (the evaluation and the public
functions), ``_report``. See docs/rewrite.md.
"""

from jax_normgrad._rewrite._report import RewriteReport
from jax_normgrad._rewrite._transform import explain_rewrite, rewrite

__all__ = ["RewriteReport", "explain_rewrite", "rewrite"]
