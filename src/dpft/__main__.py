"""``python -m dpft`` runs the ``dpft`` command, so that launchers that start a module can run it:
``torchrun --nproc_per_node=K -m dpft train RECIPE`` (multi-process data parallel, see
distributed.py) or ``accelerate launch -m dpft train RECIPE``."""

from dpft.cli.commands import app

if __name__ == "__main__":
    app(prog_name="dpft")
