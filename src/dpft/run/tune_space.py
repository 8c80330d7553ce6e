"""What a private search (run/tune.py) may vary besides the plain keys, and how long its trials run.

**Methods in the search space** (``tune.space: {methods.<method>.<field>: ...}``): a method may be
searched — its settings varied, and it switched on or off through its own fields (examples in
docs/tune.md) — when it declares ``search_events_unchanged`` (methods/base.py): every trial then records
exactly the per-step events of a plain DP-SGD trial with the same (q, T, σ), so the search's
candidates (one per configuration of the privacy-relevant choices) still cover every trial and
its settings are *free* keys (log-uniform or choice). A method whose events differ (an earlier
private phase, another mechanism) is refused: the candidates could not bound
it. Settings that make a run NOT CERTIFIED (``uncertified_fields``) are refused. Belt and braces:
a trial whose recorded events are not covered by a candidate is composed on top of the selection
in the ledger, in full (run/tune.py ``finish_search``; audited by audit/checks_tune.py).

**Time budget** (``schedule.time_budget``, ``dpft tune --time-budget``): the budget covers the whole
search. K is random and its law is the one the accounting theorem was applied to, so it is never
truncated or changed to meet a deadline; instead each trial gets budget / E[K] (the search takes the
budget on average and longer when K > E[K], with the probability printed), or with
``tune.trials.time_quantile: p`` budget / k_p (k_p the p-quantile of K: the search fits with
probability ≥ p). Within a trial's share, T for each searched batch size B is what fits after the
trial's model load and its evaluations on the scoring rows (run/timing.py measures them).

**Budget-aware (B, T)** (``batch.expected_batch_size: auto`` / ``schedule.steps: auto`` in a search
recipe; :func:`resolve_search_auto`): before K is drawn, the (B, T) of every trial is chosen by the rule
of ``dpft train``'s auto (accounting/budget.py ``choose_batch_and_steps``: at B·T = the compute budget per
trial, the smallest σ/B) with σ = each trial's σ at which the WHOLE search spends ε (the selection
bound, ``calibrate_search``), and the learning rate (the recipe's and the searched range) is scaled
with B by ``scaled_lr``. The chosen (B, T) is then the search's one configuration: its σ is the one a
recipe with these numbers typed in gets, and a resume reuses the first choice (``state.json``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import ValidationError

from dpft.accounting.budget import BudgetError, choose_batch_and_steps, scaled_lr, steps_in_time
from dpft.step.plan import planned_steps
from dpft.accounting.selection import KDistribution, calibrate_search
from dpft.config.recipe import apply_overrides
from dpft.config.tune import PRIVACY_KEYS, is_method_key
from dpft.methods.base import MethodError, get_method, method_name
from dpft.run.auto import describe_seconds, time_budget_refusal
from dpft.run.errors import TrainingError

__all__ = ["check_search_methods", "apply_hyperparameters", "time_plan", "time_budget_refusal"]


def _method_class(name: str, where: str):
    try:
        return get_method(name)
    except MethodError as exc:
        raise TrainingError(f"{where}: {exc}") from None


def check_search_methods(r) -> None:
    """Refuse methods (in ``methods:`` or ``tune.space``) a search cannot bound, NOT CERTIFIED
    settings, unknown fields and values the method's config rejects — from the recipe alone.

    Raises:
        TrainingError: naming the method, the field and the fix."""
    space = (r.tune.space or {}) if r.tune else {}
    used = [(method_name(cfg), cfg) for cfg in r.methods]
    used += [(k.split(".")[1], None) for k in space if is_method_key(k)]
    for name, cfg in used:
        cls = _method_class(name, "tune")
        if not getattr(cls, "search_events_unchanged", False):
            raise TrainingError(f"dpft tune: method {name!r} adds privacy events of its own (an earlier private phase "
                                "or another mechanism), which the search's candidates cannot bound yet; remove it from "
                                "methods: and tune.space (methods a search may vary: those leaving the events "
                                "unchanged: docs/tune.md)")
        for f in getattr(cls, "uncertified_fields", ()):
            if cfg is not None and getattr(cfg, f, False):
                raise TrainingError(f"dpft tune: {name}.{f} makes a run NOT CERTIFIED; a search needs certified trials")
    for key, spec in space.items():
        if not is_method_key(key):
            continue
        parts = key.split(".")
        cls = _method_class(parts[1], f"tune.space.{key}")
        fields = cls.config.model_fields
        if len(parts) != 3 or parts[2] not in fields:
            raise TrainingError(f"tune.space.{key}: {parts[1]} has no field {'.'.join(parts[2:])!r}; its fields: "
                                f"{', '.join(sorted(fields))}")
        if parts[2] in getattr(cls, "uncertified_fields", ()):
            raise TrainingError(f"tune.space.{key}: this setting makes a run NOT CERTIFIED; it cannot be searched")
        kind, vals = next(iter(spec.items()))
        for v in vals:
            try:
                _coerce(cls, parts[2], v)
            except ValidationError as exc:
                raise TrainingError(f"tune.space.{key}: value {v!r} is not valid for {parts[1]}.{parts[2]} "
                                    f"({exc.errors()[0]['msg']})") from None


def _coerce(cls, field: str, value: Any) -> Any:
    """``value`` as the method's config reads ``field`` (a log-uniform draw for an int field is rounded)."""
    try:
        return getattr(cls.config.model_validate({field: value}), field)
    except ValidationError:
        if isinstance(value, float) and not isinstance(value, bool):
            return getattr(cls.config.model_validate({field: int(round(value))}), field)
        raise


def apply_hyperparameters(d: dict, hp: dict) -> dict:
    """Set a trial's hyperparameters in a dumped recipe ``d``: dotted keys as overrides, and
    ``methods.<name>.<field>`` in the ``methods`` list entry of that name (added when absent)."""
    apply_overrides(d, {k: v for k, v in hp.items() if not is_method_key(k)})
    for k, v in hp.items():
        if not is_method_key(k):
            continue
        _, name, field = k.split(".", 2)
        methods = list(d.get("methods") or [])
        entry = next((m for m in methods if m.get("name") == name), None)
        if entry is None:
            entry = {"name": name}
            methods.append(entry)
        entry[field] = _coerce(get_method(name), field, v)
        d["methods"] = methods
    return d


def _batches(r, combos: list[dict]) -> list[int]:
    return sorted({int(c.get("batch.expected_batch_size", r.batch.expected_batch_size)) for c in combos})


def _probe_recipe(r, combos: list[dict]):
    """The recipe the probe times: the largest searched batch, deepest ``trainable.last_k`` and
    largest LoRA rank of the space (the slowest trial of those keys)."""
    space = r.tune.space or {}
    d = r.model_dump(mode="json")
    d["tune"] = None
    d["schedule"].update({"time_budget": None, "steps": 1, "epochs": None})
    d["batch"]["expected_batch_size"] = max(_batches(r, combos))
    for key in ("trainable.last_k", "trainable.lora.r"):
        if key in space:
            apply_overrides(d, {key: int(math.ceil(max(float(v) for v in next(iter(space[key].values())))))})
    return type(r).model_validate(d)


def time_plan(r, n_fit: int, n_score: int, num_labels: int, dist, combos: list[dict], timing=None,
              with_timing: bool = False) -> tuple:
    """T for each searched batch size so that the search fits ``schedule.time_budget`` (module
    docstring), and the explanation to print. Returns ``({str(B): T}, message)`` (and the probe's
    timing as a third item with ``with_timing``).

    Raises:
        TrainingError: a trial's share fits no step (raise the budget, lower E[K] or max_length)."""
    from dpft.run.timing import probe_step_time

    budget = float(r.schedule.time_budget)
    p = r.tune.trials.time_quantile
    k_plan = dist.mean() if p is None else max(1, dist.tail_quantile(1.0 - p))
    share = budget / max(k_plan, 1e-9)
    timing = timing or probe_step_time(_probe_recipe(r, combos), num_labels)
    ev = timing.eval_seconds(n_score)
    room = share - timing.setup_seconds - ev  # each trial loads its model and is scored once more by the search
    # a trial is evaluated only by the search's score (run/tune.py NEVER: no periodic evaluation)
    steps = {str(b): steps_in_time(room, timing.step_seconds(b, n_fit), ev, 10 ** 9)
             for b in _batches(r, combos)}
    if min(steps.values()) < 1:
        raise TrainingError(f"tune: a trial's share of the time budget ({describe_seconds(share)} = "
                            f"{describe_seconds(budget)} / {k_plan:.3g}) fits no step; raise --time-budget, lower "
                            "tune.trials.mean or model.max_length")
    over = 1.0 - dist.cdf(int(math.floor(k_plan)))
    k90 = dist.tail_quantile(0.1)
    msg = [f"time budget {describe_seconds(budget)} for the whole search: {timing.describe()}",
           f"  each trial: {describe_seconds(share)} = budget / "
           + (f"E[K] = {k_plan:.3g}" if p is None else f"k_{p:g} = {k_plan} (the {p:g}-quantile of K)")
           + f"; minus setup {timing.setup_seconds:.3g} s and a scoring pass over {n_score} rows",
           "  steps per trial: " + ", ".join(f"B = {b}: T = {t}" for b, t in steps.items())
           + f" (N = {n_fit} fit rows; σ is calibrated for these (q, T) before any trial)",
           f"  K is random and keeps its declared law (the accounting needs it): P[K > {math.floor(k_plan)}] = "
           f"{over:.3g} (the search then runs past the budget); at K's 90% quantile ({k90}) it takes about "
           f"{describe_seconds(k90 * share)}"]
    return (steps, "\n".join(msg), timing) if with_timing else (steps, "\n".join(msg))


def steps_for(r, hp: dict, steps_by_batch: dict[str, int] | None) -> dict:
    """``hp`` with the time plan's ``schedule.steps`` for its batch size (unchanged without a plan)."""
    if not steps_by_batch:
        return hp
    b = int(hp.get("batch.expected_batch_size", r.batch.expected_batch_size))
    return {**hp, "schedule.steps": steps_by_batch[str(b)]}


def search_auto(r) -> bool:
    """Whether the search recipe ``r`` leaves (B, T) to :func:`resolve_search_auto` (a time budget's
    ``steps: auto`` is :func:`time_plan`'s)."""
    return r.batch.expected_batch_size == "auto" or (r.schedule.steps == "auto" and r.schedule.time_budget is None)


def auto_refusal(r) -> Optional[str]:
    """Why ``auto`` in the search recipe ``r`` cannot be resolved (None: it can), from the recipe alone."""
    space = (r.tune.space or {}) if r.tune else {}
    for key in PRIVACY_KEYS:
        if any(v == "auto" for v in next(iter(space.get(key, {"choice": []}).values()))):
            return (f"tune.space.{key}: 'auto' among the choices is not supported (auto picks one (B, T) for the "
                    f"search); set {key}: auto in the recipe and remove it from tune.space, or list numbers only")
    b_auto, t_auto = r.batch.expected_batch_size == "auto", r.schedule.steps == "auto"
    timed = r.schedule.time_budget is not None
    if b_auto and timed:
        return ("dpft tune: batch.expected_batch_size: auto with a time budget is not supported; give the batch "
                "size (or search it in tune.space) and keep the time budget, or drop the time budget")
    if (b_auto or t_auto) and "trainable.mode" in space:
        return ("dpft tune: trainable.mode in tune.space brings each scope's own batch and schedule; give "
                "batch.expected_batch_size and schedule.steps/epochs numbers (or drop the scope from tune.space)")
    if b_auto and "batch.expected_batch_size" in space:
        return "dpft tune: batch.expected_batch_size is auto and searched in tune.space; keep one"
    if t_auto and not timed and {"schedule.steps", "schedule.epochs", "batch.expected_batch_size"} & set(space):
        return ("dpft tune: schedule.steps: auto chooses one (B, T) for the search; remove schedule.steps/epochs and "
                "batch.expected_batch_size from tune.space (or give schedule.steps / epochs)")
    if t_auto and not timed and r.schedule.epochs is not None:
        return "schedule.steps: auto and schedule.epochs both set; keep one"
    return None


def search_sigma(q: float, steps: int, epsilon: float, delta: float, dist: KDistribution,
                 score_sigma: Optional[float]) -> float:
    """Each trial's σ at (q, T) when the search's one configuration is (q, T): the σ at which the whole
    search (K ~ ``dist``, every trial's steps and noisy score, the selection) spends ``epsilon`` —
    ``calibrate_search`` exactly as ``dpft tune`` calls it for a recipe with these numbers typed in.

    Raises:
        SelectionError: out of reach at this (q, T) (the candidate is then left out)."""
    return calibrate_search(epsilon, delta, dist, [(q, steps)], score_sigma)[0][0]


def _typed_in(r, b: int, t: int, scale: float):
    """``r`` with (B, T) as numbers, no compute budget, and the learning rate — the recipe's and the
    searched ``optimizer.lr`` — multiplied by ``scale``: the recipe a user could have typed in."""
    d = r.model_dump(mode="json")
    d["batch"]["expected_batch_size"] = b
    d["schedule"].update({"steps": t, "epochs": None, "compute_budget": None})
    d["optimizer"]["lr"] = d["optimizer"]["lr"] * scale
    spec = (d["tune"].get("space") or {}).get("optimizer.lr")
    if spec is not None and scale != 1.0:
        kind, vals = next(iter(spec.items()))
        spec[kind] = [float(v) * scale for v in vals]
    return type(r).model_validate(d)


def resolve_search_auto(r, n: int, dist: KDistribution, score_sigma: Optional[float],
                        done: Optional[dict] = None) -> tuple[Any, dict, str]:
    """The search recipe ``r`` with its ``auto`` (B, T) chosen for ``n`` fit rows (module docstring).

    Candidates and rule as ``dpft train``'s auto (``choose_batch_and_steps``; compute budget per trial
    ``schedule.compute_budget``, default 3 epochs of the fit rows), each candidate's σ by
    :func:`search_sigma`. N (the fit rows after the scoring split) is treated as public, as ``dpft
    train``'s auto treats the training rows' count. ``done``: the choice saved when the search started
    (a resume reuses it, nothing is recomputed). Returns ``(recipe with numbers, choice, message)``;
    ``choice["sigma"]`` is the configuration's per-trial σ.

    Raises:
        BudgetError: no candidate meets the search's ε (raise ε, lower E[K] or the compute budget)."""
    b_auto = r.batch.expected_batch_size == "auto"
    eps, delta = r.privacy.target_epsilon, r.privacy.delta
    if done is None:
        if not b_auto and int(r.batch.expected_batch_size) > n:
            raise BudgetError(f"expected batch size {r.batch.expected_batch_size} exceeds the {n} fit rows; choose a "
                              "smaller batch or batch.expected_batch_size: auto")
        fixed_t = None
        if not (r.schedule.steps == "auto"):
            fixed_t = planned_steps(n, 256, int(r.schedule.steps) if r.schedule.steps else None, r.schedule.epochs)
        choice = choose_batch_and_steps(n, eps, delta, r.schedule.compute_budget,
                                        batch=None if b_auto else int(r.batch.expected_batch_size),
                                        steps=fixed_t,
                                        sigma_for=lambda q, t: search_sigma(q, t, eps, delta, dist, score_sigma))
        done = {"batch": choice.batch, "steps": choice.steps, "sigma": choice.sigma, "budget": choice.budget,
                "n_fit": n, "lr_scale": scaled_lr(1.0, choice.batch, r.optimizer.name) if b_auto else 1.0,
                "rows": choice.rows}
        again = ""
    else:
        again = " (resumed: the choice made when the search started)"
    b, t, scale = int(done["batch"]), int(done["steps"]), float(done["lr_scale"])
    lines = [f"auto (search){again}: B = {b}, T = {t} steps per trial (B·T ≈ {done['budget']} examples processed "
             f"per trial): the smallest noise on the averaged gradient σ_trial/B = {done['sigma'] / b:.4g} "
             "(σ_trial = "
             f"{done['sigma']:.4g}), σ_trial being each trial's σ at which the WHOLE search (K ~ {dist.kind}, E[K] = "
             f"{dist.mean():.3g}; noisy score σ_s = {score_sigma}) spends ε = {eps:g} at δ = {delta:g} (selection "
             "bound, accounting/selection.py), among the candidates at this compute (Sander et al. 2023):"]
    lines += [f"    B = {row['batch']:>6}  T = {row['steps']:>6}  σ_trial = {row['sigma']:8.4f}  σ_trial/B = "
              f"{row['noise_per_example']:.4g}" for row in done.get("rows", [])]
    lines.append(f"  N = {done['n_fit']} fit rows (after the scoring split; treated as public, as dpft train's auto "
                 "treats N); the search's accounting is then that of a recipe with these numbers typed in")
    if b_auto:
        lines.append(f"  learning rate (recipe {r.optimizer.lr:g}"
                     + (f"; searched optimizer.lr range {next(iter(r.tune.space['optimizer.lr'].values()))}"
                        if "optimizer.lr" in (r.tune.space or {}) else "")
                     + f") taken as tuned at B = 256 and scaled by {scale:.4g} ("
                     + ("linear" if r.optimizer.name == "sgd" else "square-root") + " rule, accounting/budget.py; "
                     "optimizer.head_lr is not scaled, as in dpft train)")
    return _typed_in(r, b, t, scale), done, "\n".join(lines)


__all__ += ["steps_for", "PRIVACY_KEYS", "search_auto", "auto_refusal", "search_sigma", "resolve_search_auto",
            "BudgetError"]
