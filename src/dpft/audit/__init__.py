"""Empirical privacy auditing of the DP step (issue 14).

* :mod:`dpft.audit.whitebox` — mechanism checks through the real :class:`~dpft.step.DPStep`
  and engines: leave-one-out sensitivity, the noise law, Poisson sampling.
* :mod:`dpft.audit.blackbox` — canary audits giving an empirical lower bound ε̂ at 95 %
  confidence: the one-step distinguishing game (Nasr et al. 2021), the one-run audit
  (Steinke, Nasr & Jagielski 2023) and a multi-step game that detects a missing subsampling.
* :mod:`dpft.audit.stats` — Clopper–Pearson bounds and the two ε̂ estimators.
* :mod:`dpft.audit.trainer_walk` — the checks through the Trainer's own step (``dpft train``'s
  code: its plan, micro-batching, privacy unit, sampler, clip policy and mechanism).
* :mod:`dpft.audit.suite` — :func:`audit_recipe` (what ``dpft audit RECIPE`` runs) and
  :func:`run_audit`; the check modules ``checks_randomness`` and ``ways_in`` join when installed.
* :mod:`dpft.audit.ways_in` — the checks every way in passes, written once over the ways in's
  adapters (``make_private``, ``DPTrainer``; the TRL trainers in :mod:`dpft.audit.ways_in_trl`): each
  reaches the private session unchanged (:mod:`dpft.audit.ways_in_session`: one check, ``dpft train`` and the
  mechanism settings included), leave-one-unit-out, the loop variants; and
  :func:`audit_make_private` / :func:`audit_dp_trainer` on your own model. The same table across
  processes (:mod:`dpft.audit.ways_in_ddp`), under FSDP (:mod:`dpft.audit.ways_in_fsdp`), for the
  plan's mechanisms and methods (:mod:`dpft.audit.ways_in_mechanisms`) and the secret state's save and
  restore (:mod:`dpft.audit.checks_resume`).
* :mod:`dpft.audit.planted` — the planted bugs of the auditor's self-test (``--plant NAME``).
* :mod:`dpft.audit.cli` — ``dpft audit RECIPE``.
* :mod:`dpft.audit.final_model` — ``dpft audit RECIPE --final-model`` (issue 37): the recipe
  trained once with secret-coin canaries, the final model scored (black-box), ε̂ on the model
  card; :mod:`dpft.audit.dirac` its white-box reference (Dirac gradient canaries on every
  release); :mod:`dpft.audit.estimators` the one-run estimators (Steinke et al. 2023, f-DP of
  Mahloujifar et al. 2025, as jax_privacy's ``CanaryScoreAuditor``).

An ε̂ below the certified ε is *not* evidence of tightness: every row carries the cap, the
largest ε̂ its trial count could have certified.
"""

from dpft.audit.stats import clopper_pearson_upper, eps_from_error_rates, one_run_epsilon  # noqa: F401
from dpft.audit.suite import audit_recipe, run_audit  # noqa: F401,E402



def __getattr__(name: str):
    """``audit_make_private`` / ``audit_dp_trainer`` (audit/ways_in.py), loaded on first use: they need
    transformers, which ``import dpft.audit`` (and ``dpft --help``) does not load."""
    if name in ("audit_make_private", "audit_dp_trainer"):
        from dpft.audit import ways_in  # deferred: a heavy load (transformers)

        return getattr(ways_in, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
