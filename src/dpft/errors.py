"""Error types shared by the driver (``run/``) and the rooms it calls (methods, perf, data,
step), in a neutral module so that none of them imports the driver to raise one."""


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, mismatched resume…); message names the fix."""


class PlanError(TrainingError, ValueError):
    """A privacy plan that cannot be certified as asked (step/plan.py, step/mechanisms.py); the
    message names the setting and the fix. A ``TrainingError`` for the CLI's driver and a
    ``ValueError`` for the Python ways in (``make_private``, ``DPTrainer``)."""


class RunLockError(TrainingError):
    """Another process holds the run folder (or state file) this one would write
    (``outputs/lock.py``); the message names the holder and the fix."""


__all__ = ["TrainingError", "PlanError", "RunLockError"]
