"""The recipe schema: the recipe and its sections (recipe.py), the base of every config model and
the run-level sections (base.py), the search's ``tune:`` section (tune.py).

The public path ``dpft.config`` (``from dpft.config import Recipe, load_recipe``) is kept here. The
schema imports no method: a recipe that names one needs the method registry handed first
(``import dpft.methods``; ``dpft.load_recipe`` and the CLI do).
"""

from dpft.config.recipe import *  # noqa: F401,F403  (the public path dpft.config)
