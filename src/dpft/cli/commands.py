"""The ``dpft`` command: ``train`` · ``predict`` · ``push`` · ``account`` · ``report`` · ``selft``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from dpft.config import recipe as _cfg
from dpft.outputs.rundir import holds_run, lock_output_dir, release_output_dir
from dpft.accounting.calibrate import CalibrationError, calibrate_sigma, check_delta, dp_sgd_event
from dpft.accounting.ledger import epsilon_of
from dpft.config.recipe import load_recipe
from dpft.outputs.report_lm import generation_summary
from dpft.outputs.report import epsilon_line, reprint
from dpft.run.errors import TrainingError
from dpft.run.tune import tune as run_tune
from dpft.run.tune_report import summary
import dpft.methods  # noqa: F401,E402 (hands the recipe schema the method registry: the CLI is its caller)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Differentially private fine-tuning of language models.")

from dpft.audit.cli import audit as _audit  # noqa: E402

app.command("audit")(_audit)


from dpft.cli.common import choices as _choices, fail as _fail, name_run as _name_run, overrides as _overrides

def _default_run_dir(name: str, no_dp: bool, resume: bool) -> tuple[Path, Optional[Path]]:
    """``runs/<name>[-nodp]`` (never ``-nodp-nodp``), or the first ``runs/<name>[-nodp]-K`` that
    holds no run when that one does. Returns ``(run_dir, taken)``, ``taken`` being the folder
    that was skipped (None when none was). ``resume``: the latest of those folders with a
    checkpoint (a run is resumed where it was written)."""
    base = name if (not no_dp or name.endswith("-nodp")) else f"{name}-nodp"
    first = Path("runs") / base
    cands = [first] + [Path("runs") / f"{base}-{k}" for k in range(2, 10_000)]

    if resume:
        with_ck = [d for d in cands[:1] if holds_run(d)]
        for d in cands[1:]:
            if not d.exists():
                break
            if holds_run(d):
                with_ck.append(d)
        return (with_ck[-1] if with_ck else first), None
    for d in cands:
        if not holds_run(d):
            return d, (first if d != first else None)
    raise typer.BadParameter(f"runs/{base}-K: no free run directory; give --output-dir")


def _resume_command(run_dir: Path, command: str = "train") -> str:
    """The command line that resumes this run: as typed (every flag and ``--set`` kept), with
    ``--output-dir RUN_DIR`` and ``--resume`` added when absent."""
    import shlex

    args = list(sys.argv[1:]) if sys.argv[1:2] == [command] else [command, "…"]
    has_out = any(a in ("-o", "--output-dir") or a.startswith("--output-dir=") for a in args)
    if not has_out:
        args += ["--output-dir", str(run_dir)]
    if "--resume" not in args:
        args.append("--resume")
    return "dpft " + " ".join(a if a == "…" else shlex.quote(a) for a in args)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _plan_line(trainer) -> str:
    """Steps, expected examples per step (q·N), N and passes over the data of a Trainer."""
    t = trainer.total_steps
    sampler = trainer.sampler
    if hasattr(sampler, "expected_batch_at"):  # batch.schedule: q varies by step
        sizes = sorted({b for _, b in sampler.schedule})
        per = f"{sizes[0]}–{sizes[-1]} expected examples per step (batch.schedule)"
        epochs = sum(sampler.q_at(i) for i in range(t))
    else:
        per = f"{trainer.q * trainer.n:.4g} expected examples per step (q·N, q = {trainer.q:.4g})"
        epochs = trainer.q * t
    unit = "examples"
    if getattr(trainer, "user_level", False):  # issue 17: q, N and epochs count users
        per = per.replace("examples", "users") + f", ≤ {sampler.k} rows each"
        unit = "users"
    return (f"plan: {t} logical steps × {per} from N = {trainer.n} training {unit} "
            f"(≈ {epochs:.3g} epochs); time estimate after the first step")


def _time_first_step(trainer) -> None:
    """Wrap this trainer's ``step`` so that after the first step run here the remaining time
    is estimated on stderr (step time × steps left; evaluation and checkpoints not counted)."""
    from tqdm.auto import tqdm

    inner = trainer.step
    state = {"timed": False}

    def step(i: int):
        t0 = time.perf_counter()
        out = inner(i)
        if not state["timed"]:
            state["timed"] = True
            dt = time.perf_counter() - t0
            left = trainer.total_steps - i - 1
            tqdm.write(f"first step: {dt:.2f} s; about {_duration(dt * left)} for the {left} steps left "
                       "(evaluation and checkpoints not included)", file=sys.stderr)
        return out

    trainer.step = step


#: The data flags ``dpft train`` and ``dpft tune`` share (one definition each; issue 44 item 9).
_TRAIN_FILE = typer.Option(None, help="task.train_file (CSV/TSV/JSONL/Parquet).")
_DEV_FILE = typer.Option(None, help="task.dev_file.")
_TEST_FILE = typer.Option(
    None, help="task.test_file: labelled file evaluated once after training, reported apart from dev.")
_TEXT_COLUMN = typer.Option(None, help="task.text_column.")
_TEXT_PAIR_COLUMN = typer.Option(None, help="task.text_pair_column.")
_LABEL_COLUMN = typer.Option(None, help="task.label_column.")


def _data_flags(train_file, dev_file, test_file, text_column, text_pair_column, label_column) -> tuple:
    """``(flag, recipe key, value)`` of the shared data flags."""
    return (("--train-file", "task.train_file", train_file), ("--dev-file", "task.dev_file", dev_file),
            ("--test-file", "task.test_file", test_file), ("--text-column", "task.text_column", text_column),
            ("--text-pair-column", "task.text_pair_column", text_pair_column),
            ("--label-column", "task.label_column", label_column))


_TIME_HELP = "schedule.time_budget: wall-clock budget (30m, 2h, 1h30m or seconds); T (and B when auto) chosen to fit"


def _time_budget_steps(ov: dict, origins: dict, time_budget: Optional[str]) -> None:
    """``--time-budget``: the steps are chosen by it (``schedule.steps: auto``, no epochs)."""
    if time_budget is None:
        return
    for key in ("schedule.steps", "schedule.epochs"):  # typed by the user (a default recipe's T is replaced)
        if ov.get(key) not in (None, "auto") and origins.get(key, "").startswith("--"):
            _fail(f"--time-budget chooses the number of steps: drop {origins[key]}")
    ov.update({"schedule.steps": "auto", "schedule.epochs": None})
    origins.update({"schedule.steps": "--time-budget", "schedule.epochs": "--time-budget"})


def _compute_budget_choice(ov: dict, origins: dict, compute_budget: Optional[int]) -> None:
    """``--compute-budget N``: B·T ≈ N examples processed, T chosen by the accountant (``schedule.steps:
    auto``) and B too unless ``--batch-size`` is given (accounting/budget.py: the least σ/B)."""
    if compute_budget is None:
        return
    for key in ("schedule.steps", "schedule.epochs"):
        if ov.get(key) not in (None, "auto") and origins.get(key, "").startswith("--"):
            _fail(f"--compute-budget chooses the number of steps: drop {origins[key]}")
    ov.update({"schedule.steps": "auto", "schedule.epochs": None})
    origins.update({"schedule.steps": "--compute-budget", "schedule.epochs": "--compute-budget"})
    if not origins.get("batch.expected_batch_size", "").startswith("--"):
        ov["batch.expected_batch_size"] = "auto"
        origins["batch.expected_batch_size"] = "--compute-budget"


@app.command()
def tune(
    recipe: Path = typer.Argument(..., help="YAML recipe with a tune: section."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Run directory."),
    resume: bool = typer.Option(False, "--resume", help="Continue the search (K and the trials done are kept)."),
    epsilon: Optional[float] = typer.Option(None, help="privacy.target_epsilon of the WHOLE search."),
    set: Optional[List[str]] = typer.Option(None, "--set", help="Any recipe key: --set tune.trials.mean=8"),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    time_budget: Optional[str] = typer.Option(None, "--time-budget", help=_TIME_HELP + " for the whole search "
                                              "(per trial: budget / E[K]; docs/tune.md)."),
    train_file: Optional[str] = _TRAIN_FILE,
    dev_file: Optional[str] = _DEV_FILE,
    test_file: Optional[str] = _TEST_FILE,
    text_column: Optional[str] = _TEXT_COLUMN,
    text_pair_column: Optional[str] = _TEXT_PAIR_COLUMN,
    label_column: Optional[str] = _LABEL_COLUMN,
):
    """Private random hyperparameter search (run/tune.py): K ~ the declared law of DP trials, each scored
    privately; only the best trial's model is released; the whole search is charged."""
    ov, origins = _overrides((("--epsilon", "privacy.target_epsilon", epsilon),
                              ("--output-dir", "output_dir", str(output_dir) if output_dir else None),
                              ("--time-budget", "schedule.time_budget", time_budget),
                              *_data_flags(train_file, dev_file, test_file, text_column, text_pair_column,
                                           label_column)), set)
    _time_budget_steps(ov, origins, time_budget)
    run_dir = output_dir
    try:
        rec = load_recipe(recipe, ov, origins)
        # a classifier's training file given on the command line is read as task 'files' (as dpft train)
        if train_file and rec.task.name not in ("text", "instruct", "seq2seq"):
            rec.task.name = "files"
        _name_run(rec, ov)
        run_dir = Path(rec.output_dir) if rec.output_dir else Path("runs") / f"{rec.name}-tune"
        typer.echo(f"run directory: {run_dir}\n{summary(run_tune(rec, run_dir, resume=resume, progress=not quiet))}")
    except KeyboardInterrupt:  # a trial's checkpoint and the search state (K, trials) are on disk
        typer.secho(f"interrupted; resume with: {_resume_command(run_dir, 'tune')} (K is kept)", err=True)
        raise typer.Exit(130)
    except (ValueError, TrainingError, FileNotFoundError) as exc:
        _fail(str(exc))


@app.command()
def train(
    recipe: Optional[Path] = typer.Argument(None, help="YAML recipe (see recipes/)."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Run directory."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --output-dir from its checkpoint."),
    allow_overspend: bool = typer.Option(
        False, "--allow-overspend", help="--resume: run every planned step even when steps released before a "
                                         "crash make ε end above the target (default: stop within it)."),
    no_dp: bool = typer.Option(False, "--no-dp", help="Non-private reference run (no guarantee)."),
    model: Optional[str] = typer.Option(None, help="model.name: HF folder, hub id or 'minilm'."),
    task: Optional[str] = typer.Option(None, help="task.name (sst2, sst5, imdb, qnli, files)."),
    train_file: Optional[str] = _TRAIN_FILE,
    dev_file: Optional[str] = _DEV_FILE,
    test_file: Optional[str] = _TEST_FILE,
    text_column: Optional[str] = _TEXT_COLUMN,
    text_pair_column: Optional[str] = _TEXT_PAIR_COLUMN,
    label_column: Optional[str] = _LABEL_COLUMN,
    user_column: Optional[str] = typer.Option(
        None, help="task.user_column: privacy unit = user (Poisson sampling over users, ≤ k rows each, "
                   "a user's summed gradient clipped to C); --batch-size then counts users."),
    max_rows_per_user: Optional[int] = typer.Option(None, help="task.max_rows_per_user (k, user level)."),
    max_train_examples: Optional[int] = typer.Option(None, help="task.max_train_examples."),
    max_dev_examples: Optional[int] = typer.Option(None, help="task.max_dev_examples."),
    trainable: Optional[str] = typer.Option(None, help=f"trainable.mode: {_choices(_cfg.TrainableCfg, 'mode')}."),
    epsilon: Optional[float] = typer.Option(None, help="privacy.target_epsilon."),
    delta: Optional[float] = typer.Option(None, help="privacy.delta."),
    noise_multiplier: Optional[float] = typer.Option(None, help="privacy.noise_multiplier (skips calibration)."),
    clip_norm: Optional[float] = typer.Option(None, help="privacy.clipping.max_norm (C)."),
    clipping: Optional[str] = typer.Option(
        None, help=f"privacy.clipping.style: {_choices(_cfg.ClippingCfg, 'style')}."),
    engine: Optional[str] = typer.Option(None, help=f"privacy.engine: {_choices(_cfg.PrivacyCfg, 'engine')}."),
    optimizer: Optional[str] = typer.Option(None, help=f"optimizer.name: {_choices(_cfg.OptimizerCfg, 'name')}."),
    lr: Optional[float] = typer.Option(None, help="optimizer.lr."),
    steps: Optional[int] = typer.Option(None, help="schedule.steps: logical (noisy) steps; clears schedule.epochs."),
    epochs: Optional[float] = typer.Option(
        None, help="schedule.epochs: passes over the training data, steps = ⌈epochs·N / batch size⌉; "
                   "clears schedule.steps."),
    batch_size: Optional[int] = typer.Option(None, help="batch.expected_batch_size (q·N)."),
    max_physical_batch_size: Optional[int] = typer.Option(None, help="batch.max_physical_batch_size."),
    max_length: Optional[int] = typer.Option(None, help="model.max_length."),
    device: Optional[str] = typer.Option(None, help="perf.device: auto (CUDA when present), cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, help=f"perf.dtype: {_choices(_cfg.PerfCfg, 'dtype')} (autocast; "
                                        "norms, clipped sums and noise stay fp32)."),
    eval_every: Optional[int] = typer.Option(None, help="eval.every_steps."),
    checkpoint_every: Optional[int] = typer.Option(None, help="checkpoint_every: write a checkpoint every N steps "
                                                   "(and at the end)."),
    seed: Optional[int] = typer.Option(None, help="seed."),
    name: Optional[str] = typer.Option(None, help="run name (default: the --train-file stem, else "
                                       "<task>-<model>); the run directory defaults to runs/<name>."),
    set: Optional[List[str]] = typer.Option(None, "--set", help="Any recipe key: --set optimizer.weight_decay=0.01"),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar, plan or time estimate."),
    time_budget: Optional[str] = typer.Option(None, "--time-budget", help=_TIME_HELP + " (run/timing.py)."),
    compute_budget: Optional[int] = typer.Option(
        None, "--compute-budget", min=1, help="schedule.compute_budget: examples processed (B·T); T, and B unless "
        "--batch-size, chosen by the accountant for the least noise per averaged gradient σ/B (accounting/budget.py)."),
):
    """Fine-tune a model under (ε, δ)-DP as a recipe says; flags override recipe keys."""
    from dpft.run.loop import Trainer, TrainingError, TrainingInterrupted

    if steps is not None and epochs is not None:
        _fail("give --steps or --epochs, not both")
    lock = None
    ov, origins = _overrides((
        ("--model", "model.name", model), ("--task", "task.name", task),
        *_data_flags(train_file, dev_file, test_file, text_column, text_pair_column, label_column),
        ("--user-column", "task.user_column", user_column),
        ("--max-rows-per-user", "task.max_rows_per_user", max_rows_per_user),
        ("--max-train-examples", "task.max_train_examples", max_train_examples),
        ("--max-dev-examples", "task.max_dev_examples", max_dev_examples), ("--trainable", "trainable.mode", trainable),
        ("--epsilon", "privacy.target_epsilon", epsilon), ("--delta", "privacy.delta", delta),
        ("--noise-multiplier", "privacy.noise_multiplier", noise_multiplier),
        ("--clip-norm", "privacy.clipping.max_norm", clip_norm), ("--clipping", "privacy.clipping.style", clipping),
        ("--engine", "privacy.engine", engine), ("--optimizer", "optimizer.name", optimizer),
        ("--lr", "optimizer.lr", lr), ("--steps", "schedule.steps", steps), ("--epochs", "schedule.epochs", epochs),
        ("--batch-size", "batch.expected_batch_size", batch_size),
        ("--max-physical-batch-size", "batch.max_physical_batch_size", max_physical_batch_size),
        ("--max-length", "model.max_length", max_length), ("--eval-every", "eval.every_steps", eval_every),
        ("--device", "perf.device", device), ("--dtype", "perf.dtype", dtype),
        ("--checkpoint-every", "checkpoint_every", checkpoint_every), ("--seed", "seed", seed), ("--name", "name", name),
        ("--output-dir", "output_dir", str(output_dir) if output_dir else None),
        ("--time-budget", "schedule.time_budget", time_budget),
        ("--compute-budget", "schedule.compute_budget", compute_budget),
    ), set)
    if no_dp:
        ov["privacy.enabled"] = False
        origins["privacy.enabled"] = "--no-dp"
    if steps is not None:
        ov["schedule.epochs"] = None
    if epochs is not None:
        ov["schedule.steps"] = None
    try:
        if recipe is None:  # no recipe: the task's tuned one under the flags, not bare defaults (issue 36)
            from dpft.run.defaults import default_overrides

            base, what = default_overrides(ov.get("task.name", "files"), ov.get("model.name", "minilm"))
            if (base.get("schedule.steps") is not None and not {"batch.expected_batch_size", "schedule.steps",
                                                                 "schedule.epochs", "optimizer.lr"} & ov.keys()):
                # a newcomer's `--epsilon 3 --train-file f.csv`: (B, T) by the accountant and the lr scaled
                # with B (issue 35 item 3); any of these flags given keeps the tuned recipe's values
                base.update({"batch.expected_batch_size": "auto", "schedule.steps": "auto"})
                what += "; expected batch and steps: auto (chosen below)"
            ov, origins = {**base, **ov}, {**{k: f"the default recipe ({k})" for k in base}, **origins}
            if not quiet and int(os.environ.get("RANK", "0") or 0) == 0:
                typer.echo(what, err=True)
        _time_budget_steps(ov, origins, time_budget)
        _compute_budget_choice(ov, origins, compute_budget)
        rec = load_recipe(recipe, ov, origins)
        # a causal-LM corpus or instruction file keeps its task; a classifier's file is 'files'
        if train_file and not task and rec.task.name not in ("text", "instruct", "seq2seq"):
            rec.task.name = "files"
        _name_run(rec, ov)
        if rec.task.test_file and not Path(rec.task.test_file).is_file():  # before any loading
            _fail(f"test file not found: {rec.task.test_file}")
        from dpft.models.load import model_source_problem

        if model_source_problem(rec.model.name):  # a missing folder, an uncached hub id offline: before any loading
            _fail(model_source_problem(rec.model.name))
        taken = None
        if rec.output_dir:
            run_dir = Path(rec.output_dir)
        else:
            run_dir, taken = _default_run_dir(rec.name, no_dp, resume)
        # Checked before any model or data is loaded (tens of seconds for a real model), and locked
        # for this process before anything is written (outputs/lock.py; under torchrun rank 0 holds it).
        if int(os.environ.get("RANK", "0") or 0) == 0:
            lock = lock_output_dir(run_dir, resume)
        if taken is not None:
            typer.echo(f"{taken} holds an earlier run; this run writes to {run_dir}", err=True)
        from dpft.run.auto import resolve_auto

        # batch/steps auto (accounting/budget.py): reads N, so after the folder checks, before the plan
        rec, chosen = resolve_auto(rec, resume_dir=run_dir if resume else None)
        if chosen and not quiet:
            typer.echo(chosen, err=True)
        trainer = Trainer(rec, run_dir, resume=resume, progress=not quiet, allow_overspend=allow_overspend)
        main = trainer.world.is_main  # DDP (torchrun): rank 0 alone talks; the others are quiet
        quiet = quiet or not main
        # A forward-LDP method's run (methods/ewft/method.py ``LDPRun``) lives on the method, not the Trainer.
        ldp = next((m.ldp for m in trainer.methods if getattr(m, "ldp", None) is not None), None)
        if main and trainer.private:
            typer.echo(f"σ = {trainer.sigma:.4f} for target ε = {rec.privacy.target_epsilon} at δ = "
                       f"{rec.privacy.delta:g}: q = {trainer.q:.5f}, {trainer.total_steps} steps, "
                       f"N = {trainer.n}, C = {rec.privacy.clipping.max_norm:g}", err=True)
        elif main and ldp is not None:
            claim = (f"for ε = {ldp.schedule.epsilon:.4g}" if trainer.ledger.certified
                     else "NOT CERTIFIED (see the report)")
            typer.echo(f"forward LDP at {rec.ldp.position}: σ_e = {ldp.schedule.sigmas} "
                       f"({ldp.schedule.method}) {claim} at δ = "
                       f"{rec.ldp.delta:g}: q = {trainer.q:.5f}, {trainer.total_steps} steps", err=True)
        elif main:
            typer.secho("WARNING: --no-dp: this run has NO privacy guarantee", fg="yellow", err=True)
        if not quiet:
            typer.echo(_plan_line(trainer), err=True)
            _time_first_step(trainer)
        rep = trainer.run()
    except TrainingInterrupted as exc:
        spent = ""
        try:  # what the releases so far cost, from the run's ledger (a user who stops for good wants it)
            eps = trainer.epsilon_now()
            if eps is not None and main:
                spent = f"ε spent so far = {eps:.4g} at δ = {rec.privacy.delta:g} ({exc.released} releases in the ledger)"
        except Exception:  # noqa: BLE001 - the message never hides the resume command
            pass
        if spent:
            typer.secho(spent, fg="yellow", err=True)
        typer.secho(f"{exc.describe()}; resume with: {_resume_command(run_dir)}", fg="yellow", err=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:  # outside the training loop's own handling (loading, or writing the report)
        t, d = locals().get("trainer"), locals().get("run_dir")
        ck = getattr(t, "_last_checkpoint", None)
        if t is None or ck is None:
            live = d / "ledger.json" if d is not None else None
            said = (f"{live} holds every release so far (e.g. an earlier phase)" if live is not None and live.is_file()
                    else "nothing was released")
            typer.secho(f"interrupted before training started: {said}", fg="yellow", err=True)
        else:
            typer.secho(f"interrupted after training; checkpoint at step {ck}; resume with: "
                        f"{_resume_command(run_dir)} (it writes the model and the report)", fg="yellow", err=True)
        raise typer.Exit(130)
    except (ValueError, TrainingError, FileNotFoundError) as exc:  # RecipeError, DataError, ModelError, CalibrationError are ValueErrors
        _fail(str(exc))
    except OSError as exc:  # e.g. a folder that became read-only, a full disk
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        _fail(f"cannot write{where}: {exc.strerror or exc}; choose another --output-dir or free the disk")
    finally:
        if lock is not None:
            release_output_dir(lock)
    if not main:
        return
    typer.echo(f"run directory: {run_dir}")
    if "dev_accuracy" in rep["metrics"]:
        typer.echo(f"dev accuracy: {rep['metrics']['dev_accuracy']:.4f}")
    else:
        typer.echo(f"dev loss: {rep['metrics']['dev_loss']:.4f} nats/token, perplexity {rep['metrics']['dev_perplexity']:.3f}")
    if rep.get("test"):
        typer.echo(f"test accuracy: {rep['test']['test_accuracy']:.4f} ({rep['test']['n']} examples; once, after training)")
    for line in generation_summary(rep):  # instruct: exact match, ROUGE-L; a warning if all generations agree
        typer.secho(line, fg="yellow" if line.startswith("WARNING") else None)
    typer.echo(epsilon_line(rep))


@app.command()
def predict(
    run_dir: Path = typer.Argument(..., help="A finished run directory."),
    file: Path = typer.Option(..., "--file", "-f", help="Rows to predict (CSV/TSV/JSONL/Parquet, the training "
                              "file's columns; labels optional)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="JSON-lines output (default: "
                                          "<file>.predictions.jsonl)."),
    batch_size: int = typer.Option(64, help="Rows per batch."),
    max_new_tokens: int = typer.Option(40, help="Causal LM: tokens generated per row."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """Labels (classifier) or generations (causal LM) for each row of --file; accuracy when it has labels."""
    from dpft.run.predict import predict as _predict

    if not file.is_file():
        _fail(f"file not found: {file}")
    try:
        out = _predict(run_dir, file, output, batch_size=batch_size, max_new_tokens=max_new_tokens, device=device,
                       progress=not quiet)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    typer.echo(f"{out['n']} predictions written to {out['output']}")
    if "accuracy" in out:
        typer.echo(f"accuracy: {out['accuracy']:.4f} ({out['n']} rows)")


@app.command()
def push(
    run_dir: Path = typer.Argument(..., help="A finished run directory."),
    repo_id: str = typer.Argument(..., help="Hugging Face model repository, e.g. you/sst2-dp."),
    public: bool = typer.Option(False, "--public", help="Create the repository public (default: private)."),
    token: Optional[str] = typer.Option(None, help="Hub token (default: your `hf auth login` token)."),
):
    """Upload the run's release set (model at the root, model card, report, ledger) to the Hub."""
    from dpft.outputs.hub import push as _push, push_failure

    try:
        url = _push(run_dir, repo_id, private=not public, token=token)
    except FileNotFoundError as exc:
        _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - offline, no network, token: one line (outputs/hub.py)
        msg = push_failure(exc, repo_id)
        if msg is None:
            raise
        _fail(msg)
    typer.echo(f"pushed {run_dir} to {repo_id}: {url}")


@app.command()
def account(
    sampling_rate: float = typer.Option(..., "--sampling-rate", "-q", help="Poisson sampling rate q."),
    steps: int = typer.Option(..., "--steps", help="Number of steps."),
    delta: float = typer.Option(1e-5, "--delta", help="Target δ."),
    noise_multiplier: Optional[float] = typer.Option(None, "--noise-multiplier", "--sigma", help="σ → ε"),
    epsilon: Optional[float] = typer.Option(None, "--epsilon", help="target ε → σ"),
    n: Optional[int] = typer.Option(None, "--n", help="Dataset size N (checks δ < 1/N)."),
):
    """Privacy accounting both ways: σ → ε (PLD and RDP), or target ε → σ."""
    if (noise_multiplier is None) == (epsilon is None):
        _fail("give exactly one of --noise-multiplier (σ → ε) or --epsilon (ε → σ)")
    try:
        check_delta(delta, n)
        if noise_multiplier is not None:
            rep = epsilon_of([dp_sgd_event(noise_multiplier, sampling_rate, steps)], delta)
            typer.echo(f"σ = {noise_multiplier:g}, q = {sampling_rate:g}, {steps} steps, δ = {delta:g}")
            typer.echo(f"ε = {rep.epsilon:.6g} (PLD)")
            typer.echo(f"ε = {rep.epsilon_rdp:.6g} (RDP)")
        else:
            sigma = calibrate_sigma(epsilon, delta, sampling_rate, steps)
            rep = epsilon_of([dp_sgd_event(sigma, sampling_rate, steps)], delta)
            typer.echo(f"target ε = {epsilon:g}, q = {sampling_rate:g}, {steps} steps, δ = {delta:g}")
            typer.echo(f"σ = {sigma:.6g} (certified ε = {rep.epsilon:.6g} PLD, {rep.epsilon_rdp:.6g} RDP)")
    except CalibrationError as exc:
        _fail(str(exc))


@app.command()
def report(run_dir: Path = typer.Argument(..., help="A finished run directory.")):
    """Reprint a run's report (ε recomputed from its ledger)."""
    try:
        typer.echo(reprint(run_dir))
    except FileNotFoundError as exc:
        _fail(str(exc))


from dpft.cli.methods import ldp_client, ldp_server, selft  # noqa: E402 (method commands)

app.command("ldp-server")(ldp_server)
app.command("ldp-client")(ldp_client)
app.command()(selft)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
