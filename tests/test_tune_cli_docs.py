"""Every `dpft tune` / `dpft train` command in docs/tune.md and the tune recipes' comments runs as written
(issue 44 item 9): it parses, and a tune command's recipe loads with its flags; the resume command printed
after Ctrl-C is the command as typed plus --resume."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[str]:
    out = []
    texts = [(ROOT / "docs" / "tune.md").read_text()] + [p.read_text() for p in sorted((ROOT / "recipes").glob("tune-*.yaml"))]
    for text in texts:
        for line in text.splitlines():
            line = re.sub(r"^#\s*", "", line.strip())
            if line.startswith(("dpft tune ", "dpft train ")):
                out.append(re.sub(r"\s+#.*$", "", line))
    return out


CMDS = documented_commands()


def test_found_the_documented_commands():
    assert sum(c.startswith("dpft tune") for c in CMDS) >= 5 and any(c.startswith("dpft train") for c in CMDS)


@pytest.mark.parametrize("cmd", CMDS)
def test_documented_command_runs_as_written(cmd, monkeypatch):
    import typer.main
    from typer.testing import CliRunner

    import dpft.cli.commands as cli

    args = shlex.split(cmd)[1:]
    group = typer.main.get_command(cli.app)
    group.commands[args[0]].make_context(args[0], list(args[1:]))  # raises UsageError on a bad flag or extra argument
    if args[0] != "tune":
        return
    seen = {}

    def fake(rec, run_dir, resume=False, progress=True):
        seen.update(rec=rec, run_dir=run_dir, resume=resume)
        return {"fake": True}

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "run_tune", fake)
    monkeypatch.setattr(cli, "summary", lambda rep: "ok")
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    rec = seen["rec"]
    assert rec.tune is not None and seen["resume"] == ("--resume" in args)
    if "--train-file" in args:
        assert rec.task.name == "files" and rec.task.train_file == args[args.index("--train-file") + 1]
    if "--test-file" in args:
        assert rec.task.test_file == args[args.index("--test-file") + 1]


def test_resume_command_after_ctrl_c_is_complete(monkeypatch):
    from typer.testing import CliRunner

    import dpft.cli.commands as cli

    args = ["tune", "recipes/tune-sst2-minilm.yaml", "-o", "runs/x", "--epsilon", "3", "--set", "tune.trials.mean=3",
            "--set", "optimizer.weight_decay=0.01", "--train-file", "my file.csv"]

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "run_tune", interrupted)
    monkeypatch.setattr(sys, "argv", ["dpft", *args])
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 130
    line = res.output.split("resume with: ", 1)[1].split(" (K is kept)")[0]
    assert shlex.split(line) == ["dpft", *args, "--resume"]
