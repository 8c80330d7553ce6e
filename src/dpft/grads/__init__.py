"""Per-example gradient engines and the book-keeping layer rules.

Importing the package registers the built-in rules (each rule file registers itself with
:func:`dpft.grads.registry.register_layer` on import); the registry never imports them back.
"""

from dpft.grads import registry  # noqa: F401  (first: the rules below register into it)
from dpft.grads import conv1d, embedding, layernorm, linear, lora, relbias, rmsnorm  # noqa: F401,E402
