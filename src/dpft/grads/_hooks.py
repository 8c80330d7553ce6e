"""Shared machinery of the book-keeping engine: per-example gradient *contributions* and the
forward/backward capture that produces them.

Book-keeping (Bu, Wang, Zha, Karypis, ICML 2023, "Differentially private optimization on large
model at small cost", the book-keeping algorithm) needs, for every trainable layer, the input activations ``A``
kept by a forward hook and the output gradients ``B`` seen by a backward hook. Each layer file
(``linear.py``, ``embedding.py``, ...) turns ``(A, B)`` into one :class:`Contribution` per
parameter; this module owns the algebra every layer kind shares:

* :class:`PerExample` -- an instantiated per-example gradient ``(B, *param.shape)``; used where it
  is as small as the activations (biases, LayerNorm/RMSNorm weights, fallback modules).
* :class:`Outer` -- a per-example gradient of a 2-D parameter ``(R, C)`` kept in factored form
  ``g_i = sum_t u_{i,t} v_{i,t}^T`` with ``U: (B, T, R)`` and ``V: (B, T, C)``. Either side may be
  an *index* side ``(B, T)`` int64 standing for one-hot rows (embedding tables). Its squared norm
  is the ghost norm (Li, Tramer, Liang, Hashimoto, ICLR 2022, "Large language models can be
  strong differentially private learners", ghost clipping; as used by Bu et al. 2023)::

      ||g_i||_F^2 = <U_i U_i^T, V_i V_i^T>_F          cost B T^2 (R + C)

  or, when cheaper, the instantiated ``||U_i^T V_i||_F^2`` (cost ``B T R C``, computed in
  example chunks so at most ~``_CHUNK_ELEMS`` floats exist at once). The clipped sum
  ``sum_i c_i U_i^T V_i`` is ONE matrix product ``(c*U)^T V`` over the ``B*T`` rows (or one
  ``index_add_`` for an index side), so no second backward pass is needed.

Several contributions to the same parameter (tied weights such as an embedding shared with the
LM head, or a module called twice) are summed *before* taking the norm, with exact cross terms
``2 <g_a, g_b>`` (see :func:`cross`).

The capture (:class:`Capture`) registers forward hooks on the trainable modules only for the
duration of one forward pass. During the main pass the engine switches the trainable
parameters to ``requires_grad=False``: autograd then never computes a weight gradient (no
``.grad`` is ever written) and the only backward work is activation-gradient propagation. Module
outputs that thereby lose ``requires_grad`` are re-marked as graph leaves, and the engine asks
``torch.autograd.grad`` for those leaves only; all other output gradients arrive in tensor
hooks, where each layer immediately reduces them to its contributions.
This module re-exports the three files it was split into: ``contrib.py`` (the contributions'
algebra), ``kinds.py`` (the layer-rule protocol and batch layouts), ``capture.py`` (the hooks).
"""

from dpft.grads.capture import Capture, Unit  # noqa: F401
from dpft.grads.contrib import (NORM_MODES, BatchLayoutError, Contribution, GramCache, Outer,  # noqa: F401
                                PerExample, ScaledCache, _index_sq_norm, cross, full_precision, in_backward,
                                merge, outer_sq_norm, sq_norm, use_ghost, weighted_sum, zero_examples)
from dpft.grads.kinds import (LayerKind, LayoutError, as_3d, batch_first, check_batch,  # noqa: F401
                              check_example_support, first_input, save_input)
