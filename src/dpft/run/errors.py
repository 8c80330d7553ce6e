"""The driver's error type, in a file of its own so that the plan builders of every room (perf,
data, models, step) can raise it without importing the loop."""


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, mismatched resume…); message names the fix."""
