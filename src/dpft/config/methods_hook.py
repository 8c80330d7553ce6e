"""The recipe schema's side of the method registry: what the schema asks of it (:class:`MethodsSchema`)
and the registry its callers hand it (:func:`set_methods_schema`). Re-exported by config/recipe.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel

__all__ = ["MethodsSchema", "NO_REGISTRY", "set_methods_schema", "methods_schema", "handed_schema"]


@dataclass(frozen=True)
class MethodsSchema:
    """What the recipe schema asks of the method registry, handed to it by the registry's callers
    (:func:`set_methods_schema`; importing the package ``dpft.methods`` hands the built-in registry,
    and the CLI, ``dpft.train``, ``dpft.load_recipe`` and the Python ways in import it), so that
    the schema imports no method and loads none by name (issue 34: the house has one direction,
    methods → config; issue 46 item 6). Without one the schema knows no method: a recipe without
    ``methods:`` (or a method section) validates, one with them is refused naming the fix.

    Attributes:
        legacy_sections: ``() -> {section: method name}``, the built-ins' historical top-level
            sections (``subspace:`` → ``dpsft``, …), moved into ``methods:``.
        config_model: ``name -> pydantic model`` of a registered method; raises a ``ValueError``
            naming the registered methods (and the closest one) when ``name`` is unknown.
        name_of: ``validated config -> its method's registered name`` (for the YAML dump).
    """

    legacy_sections: Callable[[], dict[str, str]]
    config_model: Callable[[str], type[BaseModel]]
    name_of: Callable[[BaseModel], str]


_METHODS_SCHEMA: Optional[MethodsSchema] = None
#: Why a recipe that names a method cannot be validated without a registry (and the fix).
NO_REGISTRY = ("the recipe schema was handed no method registry, so it knows no method: `import dpft.methods` "
               "first (it hands the built-in registry; `dpft train`, dpft.train and dpft.load_recipe do), or hand "
               "your own with dpft.config.recipe.set_methods_schema")


def set_methods_schema(schema: MethodsSchema) -> None:
    """Hand the schema the method registry's side (:class:`MethodsSchema`); the registry's callers
    do, before a recipe that names a method is loaded (``import dpft.methods`` hands the built-in one)."""
    global _METHODS_SCHEMA
    _METHODS_SCHEMA = schema


def methods_schema() -> MethodsSchema:
    """The :class:`MethodsSchema` handed to the schema.

    Raises:
        ValueError: none was handed (:data:`NO_REGISTRY` names the fix).
    """
    if _METHODS_SCHEMA is None:
        raise ValueError(NO_REGISTRY)
    return _METHODS_SCHEMA


def handed_schema() -> Optional[MethodsSchema]:
    """The :class:`MethodsSchema` handed to the schema, or None (a recipe that names no method)."""
    return _METHODS_SCHEMA
