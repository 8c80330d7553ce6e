"""The private session under every way in (DESIGN.md "Layout", issue 46): the world and its secret
key (:func:`session_world`), the step for this world (:func:`step_for`)."""

from dpft.session.step import step_for
from dpft.session.world import session_world

__all__ = ["session_world", "step_for"]
