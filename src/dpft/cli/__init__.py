"""The ``dpft`` command line: ``dpft.cli:app`` (the Typer app) and ``dpft.cli:main`` (the console
script) are kept here. The commands are in commands.py (train · predict · push · account · report ·
tune · audit), the method commands in methods.py, the helpers they share in common.py."""

from dpft.cli.commands import app, main

__all__ = ["app", "main"]
