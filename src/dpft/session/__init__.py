"""The private session under every way in (DESIGN.md "Layout", issue 46): :class:`PrivateSession`
(the world and its secret key from :func:`session_world`, the unit, the methods' preparation, the
plan, the step for this world from :func:`step_for`, the versioned secret state) over one
:class:`SessionSettings`."""

from dpft.session.core import PrivateSession, SessionSettings
from dpft.session.step import step_for
from dpft.session.world import session_world

__all__ = ["PrivateSession", "SessionSettings", "session_world", "step_for"]
