"""Issue 23 "release honesty": dev texts in report.md only when the dev set is public; a
reproducible run is headed NOT CERTIFIED for release (its ε conditional on the seed)."""

from __future__ import annotations

import json

from dpft.config.recipe import TaskCfg
from dpft.outputs.report_lm import render_extra
from dpft.outputs.report import NOT_FOR_RELEASE, dev_is_public, withhold_private_dev_texts
from test_trust import _recipe


def test_dev_is_public_only_for_benchmark_data(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "e2e").mkdir(parents=True)
    own = tmp_path / "mine.csv"
    monkeypatch.setenv("DPFT_DATA_DIR", str(data))
    assert dev_is_public(TaskCfg(name="sst2"))  # named benchmark: its dev split
    assert dev_is_public(TaskCfg(name="instruct", train_file=str(own), dev_file=str(data / "e2e" / "devset.csv")))
    assert not dev_is_public(TaskCfg(name="files", train_file=str(own), dev_file=str(own)))  # the user's dev file
    assert not dev_is_public(TaskCfg(name="files", train_file=str(own)))  # held out from --train-file
    assert not dev_is_public(TaskCfg(name="instruct", train_file=str(data / "e2e" / "t.csv")))
    monkeypatch.delenv("DPFT_DATA_DIR")
    assert not dev_is_public(TaskCfg(name="instruct", train_file=str(own), dev_file=str(data / "e2e" / "devset.csv")))


def _gen_rep(public: bool) -> dict:
    sample = {"prompt": "name[Secret Cafe] area[riverside]", "generation": "It is by the river.",
              "references": ["Secret Cafe is a private place by the river."]}
    return {"coverage": {"dev_public": public},
            "generation": {"metrics": {"dev_bleu": 1.0, "dev_rouge_l": 2.0, "dev_exact_match": 0.0},
                           "settings": {"decoding": "greedy", "max_new_tokens": 8, "prompts": 1, "references": 1},
                           "samples": [sample]}}


def test_private_dev_texts_are_withheld_public_ones_printed():
    md = "\n".join(render_extra(withhold_private_dev_texts(_gen_rep(public=False))))
    assert "Secret Cafe" not in md and "1 dev generations and their references are not printed" in md
    rep = withhold_private_dev_texts(_gen_rep(public=False))
    assert rep["generation"]["samples"] == [] and rep["generation"]["samples_withheld"] == 1
    assert "Secret Cafe" not in json.dumps(rep)  # report.json too
    md = "\n".join(render_extra(withhold_private_dev_texts(_gen_rep(public=True))))
    assert "Secret Cafe is a private place by the river." in md and "not printed" not in md


def test_reproducible_run_is_headed_not_certified_for_release(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    Trainer(_recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True}), tmp_path / "r",
            progress=False).run()
    md = (tmp_path / "r" / "report.md").read_text()
    head = next(x for x in md.splitlines() if x.startswith("**Privacy:**"))
    assert head.startswith(f"**Privacy:** {NOT_FOR_RELEASE}")
    assert "ε = " in head and "holds only while that seed stays secret" in head
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["privacy"]["certified_for_release"] is False and rep["privacy"]["epsilon"] > 0
    assert "seed:" in (tmp_path / "r" / "recipe.yaml").read_text()
    # a secret-key run of the same recipe says nothing of the kind
    Trainer(_recipe(tiny_model_dir, sst_like_files), tmp_path / "s", progress=False).run()
    md = (tmp_path / "s" / "report.md").read_text()
    assert "NOT CERTIFIED" not in md
    assert "certified_for_release" not in json.loads((tmp_path / "s" / "report.json").read_text())["privacy"]
