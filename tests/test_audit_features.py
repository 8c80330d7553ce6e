"""dpft audit's checks of frozen features computed once (audit/checks_features.py): pass on the
code as it is, and each planted bug is caught by its check (tiny models; seconds)."""

from __future__ import annotations

import pytest

from dpft.audit.checks_features import PLANTED, features_checks


def test_features_checks_pass():
    checks = features_checks()
    assert len(checks) == 4 and all(c.passed for c in checks), [(c.name, c.message) for c in checks]


@pytest.mark.parametrize("planted,caught_by", [("features_prefix_train_mode", "cached path"),
                                               ("features_cache_in_run_dir", "private at rest"),
                                               ("features_key_ignores_weights", "key follows"),
                                               ("features_siamese_trainable_encoder", "siamese pairs")])
def test_each_planted_bug_is_caught(planted, caught_by):
    assert planted in PLANTED
    checks = {c.name: c for c in features_checks(planted)}
    assert not next(c for n, c in checks.items() if caught_by in n).passed


def test_planted_names_registered():
    from dpft.audit import planted, suite

    assert set(PLANTED) <= set(planted.ALL)
    assert any(m == "dpft.audit.checks_features" and set(names) == set(PLANTED)
               for m, _, names in suite.OPTIONAL_CHECKS)
