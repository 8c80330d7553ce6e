"""Error types shared by the driver (``run/``) and the rooms it calls (methods, perf, data,
step), in a neutral module so that none of them imports the driver to raise one."""


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, mismatched resume…); message names the fix."""


__all__ = ["TrainingError"]
