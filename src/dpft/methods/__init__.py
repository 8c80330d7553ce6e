"""The method registry (methods/base.py) and the built-in methods, one file each.

Importing the package hands the recipe schema the registry's validator
(``dpft.config.recipe.set_methods_schema``, config/methods_hook.py; the schema imports no method)
and hands the registry the loader of the built-ins, which register themselves like any plug-in
when the registry is first read (issue 46 item 6: nothing is loaded by name, and the registry
imports no method file).
"""

from dpft.config.methods_hook import set_methods_schema
from dpft.methods.base import recipe_schema, set_builtin_loader


def _load_builtins() -> None:
    """Register the built-in methods (deferred: they import the model libraries, which ``dpft --help``
    does not load)."""
    from dpft.methods import dp_adam_ac, lpft, rmt  # noqa: F401
    from dpft.methods.dpsft import method as _dpsft  # noqa: F401
    from dpft.methods.ewft import method as _ewft  # noqa: F401


set_builtin_loader(_load_builtins)
set_methods_schema(recipe_schema())
