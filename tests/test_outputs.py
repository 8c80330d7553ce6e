"""Issue 24 items 1–2: a run's model/ loads with the standard tools as trained; model card;
push (mocked hub); dpft predict; task.test_file evaluated once and reported apart from dev."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from conftest import files_recipe
from dpft.cli.commands import app
from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer
from dpft.step.plan import PlanSettings


def tiny_recipe(model_dir, files, **extra):
    return files_recipe(model_dir, files, **{"privacy.target_epsilon": 6.0, **extra})


@pytest.fixture()
def labelled_files(tmp_path):
    """String labels (pos/neg) so that id2label must carry the names; a test file of new rows."""
    words = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull"]
    rows = [{"text": f"a {words[i % 8]} film number {i}", "label": "pos" if i % 8 % 2 == 0 else "neg"}
            for i in range(48)]
    pd.DataFrame(rows).to_csv(tmp_path / "train.csv", index=False)
    test = [{"text": f"{words[i % 8]} and {words[(i + 3) % 8]} story {i}", "label": "pos" if i % 2 == 0 else "neg"}
            for i in range(10)]
    pd.DataFrame(test).to_csv(tmp_path / "test.csv", index=False)
    pd.DataFrame([{"text": t["text"]} for t in test]).to_json(tmp_path / "unlabelled.jsonl", orient="records",
                                                               lines=True)
    return {"csv": tmp_path / "train.csv", "test": tmp_path / "test.csv", "unlabelled": tmp_path / "unlabelled.jsonl"}


def _dpft_logits(trainer, texts):
    """The trained model's own logits (dpft's collate, as in dev evaluation)."""
    from dpft.data.tokenize import collate
    from dpft.models.losses import model_inputs

    enc = [dict(trainer.tokenizer(t, truncation=True, max_length=trainer.recipe.model.max_length)) for t in texts]
    rows = [{k: v for k, v in e.items() if k in ("input_ids", "token_type_ids")} for e in enc]
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(**model_inputs(collate(rows, trainer.pad_id, trainer.with_token_types))).logits


def _pipeline_logits(model_dir, texts, labels):
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(model_dir), device="cpu")
    out = clf(texts, function_to_apply="none", top_k=None, batch_size=4)
    return torch.tensor([[next(d["score"] for d in o if d["label"] == lab) for lab in labels] for o in out])


TEXTS = ["a good film", "a dull and poor film number 3", "lovely", "an awful, awful story about nothing at all"]


@pytest.mark.parametrize("pooling", ["mean", "model"])
def test_classifier_loads_as_trained_with_auto_class_and_pipeline(tiny_model_dir, labelled_files, tmp_path, pooling):
    import dpft.models.export  # noqa: F401 - registers the mean-pooling head
    from transformers import AutoModelForSequenceClassification

    rec = tiny_recipe(tiny_model_dir, labelled_files, **{"model.pooling": pooling, "model.dropout": 0.0})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    tr.run()
    model_dir = tmp_path / "run" / "model"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["id2label"] == {"0": "neg", "1": "pos"} and cfg["label2id"] == {"neg": 0, "pos": 1}
    if pooling == "mean":
        assert cfg["model_type"] == "dpft_mean_pool" and cfg["architectures"] == ["DpftMeanPoolForSequenceClassification"]
    ours = _dpft_logits(tr, TEXTS)
    auto = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    enc = tr.tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(auto(**enc).logits, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(_pipeline_logits(model_dir, TEXTS, ["neg", "pos"]), ours, atol=1e-5, rtol=0)
    # and the folder is a valid starting point for another dpft run (warm start keeps the head)
    from dpft.models.load import load_classifier

    _, again = load_classifier(str(model_dir), 2, pooling=pooling)
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**enc).logits, ours, atol=1e-5, rtol=0)


def test_model_card_states_the_guarantee(tiny_model_dir, labelled_files, tmp_path):
    from huggingface_hub import ModelCard

    rec = tiny_recipe(tiny_model_dir, labelled_files, **{"model.pooling": "mean"})
    rep = Trainer(rec, tmp_path / "run", progress=False).run()
    card = ModelCard.load(tmp_path / "run" / "model" / "README.md")
    text = card.text
    p, dp = rep["privacy"], rep["dp"]
    assert card.data.dp_epsilon == pytest.approx(p["epsilon"], rel=1e-5) and card.data.dp_delta == 1e-3
    assert card.data.pipeline_tag == "text-classification" and "differential-privacy" in card.data.tags
    assert f"({p['epsilon']:.4g}, 0.001)-differential privacy" in text
    assert f"N = {rep['task']['n_train']:,} examples" in text and "add/remove-one" in text
    assert "Poisson-subsampled Gaussian" in text and f"{dp['noise_multiplier']:.4f}" in text
    assert f"{dp['sampling_rate']:.6f}" in text and f"| steps | {dp['steps']} |" in text
    assert "| clipping norm C | 1 (flat) |" in text and "PLD" in text and "dp-accounting" in text
    assert "What it does not cover" in text and "(dp-accounting) (dp-accounting)" not in text and "NOT covered by ε" in text  # own dev split
    assert "trust_remote_code=True" in text  # how to load the mean-pooling head without dpft (issue 36)
    # the plan as a value (step/plan.py): its settings and σ in simple types, and they rebuild the same σ
    plan = json.loads((tmp_path / "run" / "report.json").read_text())["dp"]["plan"]
    assert plan["sigma"] == dp["noise_multiplier"] and plan["steps"] == dp["steps"] and plan["mechanism"] == "gaussian"
    assert plan["n"] == rep["task"]["n_train"] and plan["target_epsilon"] == dp["target_epsilon"]
    settings = PlanSettings.from_dict({k: v for k, v in plan.items() if k != "sigma"})
    assert settings.calibrate().sigma == pytest.approx(plan["sigma"], rel=1e-9)


def test_nodp_card_says_no_guarantee(tiny_model_dir, labelled_files, tmp_path):
    rec = tiny_recipe(tiny_model_dir, labelled_files, **{"privacy.enabled": False})
    Trainer(rec, tmp_path / "run", progress=False).run()
    text = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "No privacy guarantee" in text and "differential-privacy" not in text.split("---")[1]


def test_lora_adapter_and_merged_model_match_the_trained_model(tiny_model_dir, labelled_files, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from dpft.models.export import load_for_inference

    rec = tiny_recipe(tiny_model_dir, labelled_files, **{
        "model.pooling": "mean", "model.dropout": 0.0, "model.head_dropout": 0.0, "trainable.mode": "lora",
        "trainable.lora.r": 2, "output.merge_lora": True, "optimizer.lr": 0.1})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    tr.run()
    ours = _dpft_logits(tr, TEXTS)
    adapter, merged = tmp_path / "run" / "model", tmp_path / "run" / "model_merged"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert acfg["modules_to_save"] == ["classifier"]  # the trained head travels with the adapter
    enc = tr.tokenizer(TEXTS, padding=True, return_tensors="pt")
    _, from_adapter, kind = load_for_inference(adapter)
    assert kind == "classification"
    m = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    with torch.no_grad():
        torch.testing.assert_close(from_adapter(**enc).logits, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(m(**enc).logits, ours, atol=1e-5, rtol=0)
    # LoRA actually changed the encoder (else the test would not tell adapter from base)
    from dpft.models.export import DpftMeanPoolForSequenceClassification

    base = DpftMeanPoolForSequenceClassification.from_encoder(str(tiny_model_dir), ["neg", "pos"])
    assert not torch.equal(base.encoder.encoder.layer[0].attention.self.query.weight,
                           m.encoder.encoder.layer[0].attention.self.query.weight)
    assert (merged / "README.md").is_file() and "peft" in (adapter / "README.md").read_text().split("---")[1]


def test_causal_lm_loads_with_auto_class_and_text_generation_pipeline(tmp_path):
    from transformers import AutoModelForCausalLM, pipeline

    from test_instruct import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    d = tmp_path / "tiny-llama"
    tiny_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the router is slow and the light is red ."] * 40))
    rec = load_recipe(None, {"task.name": "text", "task.train_file": str(corpus), "model.name": str(d),
                             "model.max_length": 8, "schedule.steps": 2, "batch.expected_batch_size": 8,
                             "eval.every_steps": 2, "checkpoint_every": 2, "privacy.noise_multiplier": 1.0,
                             "privacy.target_epsilon": None, "privacy.delta": 1e-3})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    tr.run()
    model_dir = tmp_path / "run" / "model"
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok("the router is", return_tensors="pt")["input_ids"]
    tr.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, tr.model(ids).logits, atol=1e-5, rtol=0)
    gen = pipeline("text-generation", model=str(model_dir), device="cpu")
    out = gen("the router is", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("the router is")
    card = (model_dir / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and 'pipeline("text-generation"' in card
    # dpft predict generates for each row
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"text": "the router"}\n{"text": "the light is"}\n')
    res = CliRunner().invoke(app, ["predict", str(tmp_path / "run"), "--file", str(rows), "--quiet",
                                   "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in Path(str(rows) + ".predictions.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["the router", "the light is"] and all("generation" in x for x in lines)


def test_test_file_reported_apart_from_dev_and_predict_gives_same_accuracy(tiny_model_dir, labelled_files, tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model_dir), "--train-file", str(labelled_files["csv"]),
        "--test-file", str(labelled_files["test"]), "-o", str(run), "--steps", "3", "--batch-size", "8",
        "--max-length", "16", "--epsilon", "6", "--delta", "1e-3", "--quiet", "--set", "model.pooling=mean"])
    assert res.exit_code == 0, res.output
    rep = json.loads((run / "report.json").read_text())
    t = rep["test"]
    assert t["n"] == 10 and t["file"] == str(labelled_files["test"]) and 0 <= t["test_accuracy"] <= 1
    assert "test_accuracy" not in rep["metrics"] and all("test_accuracy" not in h for h in rep["history"])
    md = (run / "report.md").read_text()
    assert "**Test accuracy:**" in md and "never used for selection" in md and "NOT covered by ε" in t["statement"]
    assert f"test accuracy: {t['test_accuracy']:.4f}" in res.output
    # dpft predict on the same file: the same accuracy, a label per row
    out = tmp_path / "pred.jsonl"
    res = CliRunner().invoke(app, ["predict", str(run), "--file", str(labelled_files["test"]), "-o", str(out),
                                   "--batch-size", "3"])
    assert res.exit_code == 0, res.output
    assert f"accuracy: {t['test_accuracy']:.4f} (10 rows)" in res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 10 and {x["label"] for x in lines} <= {"neg", "pos"}
    assert all(abs(sum(x["scores"]) - 1) < 1e-4 for x in lines) and lines[0]["row"] == 1
    # a file without labels: predictions, no accuracy
    res = CliRunner().invoke(app, ["predict", str(run), "--file", str(labelled_files["unlabelled"]), "--quiet"])
    assert res.exit_code == 0 and "accuracy" not in res.output and "10 predictions" in res.output


def test_test_file_errors_name_the_fix(tiny_model_dir, labelled_files, tmp_path):
    res = CliRunner().invoke(app, ["train", "--model", str(tiny_model_dir), "--train-file",
                                   str(labelled_files["csv"]), "--test-file", str(tmp_path / "nope.csv"),
                                   "-o", str(tmp_path / "r"), "--quiet"])
    assert res.exit_code == 2 and "test file not found" in res.output
    bad = tmp_path / "bad.csv"
    pd.DataFrame([{"text": "x", "label": "maybe"}]).to_csv(bad, index=False)
    from dpft.data.tasks import DataError
    from dpft.run.predict import read_rows

    with pytest.raises(DataError, match="not among the run's 2 labels"):
        read_rows(bad, "text", None, "label", ["neg", "pos"], require_labels=True)
    with pytest.raises(ValueError, match="classification tasks only"):
        load_recipe(None, {"task.name": "text", "task.train_file": "x.txt", "task.test_file": "t.txt"})


def test_push_uploads_only_the_release_set(tiny_model_dir, labelled_files, tmp_path):
    from dpft.outputs.hub import push

    rec = tiny_recipe(tiny_model_dir, labelled_files, **{"log.private_diagnostics": True,
                                                         "eval.save_predictions": True})
    Trainer(rec, tmp_path / "run", progress=False).run()
    run = tmp_path / "run"
    assert (run / "private_diagnostics.jsonl").is_file() and (run / "dev_predictions.jsonl").is_file()
    api = mock.MagicMock()
    seen = {}

    def upload_folder(folder_path, repo_id, **kw):
        seen["files"] = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*")
                               if p.is_file())
        seen["card"] = (Path(folder_path) / "README.md").read_text()
        return "https://huggingface.co/me/x/commit/abc"

    api.upload_folder.side_effect = upload_folder
    url = push(run, "me/x", api=api)
    assert url.endswith("abc")
    api.create_repo.assert_called_once_with("me/x", repo_type="model", private=True, exist_ok=True)
    files = seen["files"]
    assert "config.json" in files and "model.safetensors" in files and "README.md" in files  # model at the root
    assert {"dpft_run/report.json", "dpft_run/ledger.json", "dpft_run/report.md"} <= set(files)
    assert not any("private_diagnostics" in f or "dev_predictions" in f or f.startswith("checkpoint") for f in files)
    assert "differential privacy" in seen["card"]
    with mock.patch("dpft.outputs.hub.push", return_value="u") as p:  # the CLI passes private unless --public
        res = CliRunner().invoke(app, ["push", str(run), "me/x", "--public"])
    assert res.exit_code == 0 and p.call_args.kwargs["private"] is False


def test_model_folder_of_an_older_run_still_loads(tiny_model_dir, tmp_path):
    """Runs saved before issue 24 (bare encoder + dpft_head.safetensors) still predict."""
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    from dpft.models.export import load_for_inference
    from dpft.models.load import MeanPoolClassifier

    enc = AutoModel.from_pretrained(tiny_model_dir, add_pooling_layer=False)
    m = MeanPoolClassifier(enc, 3, 0.0).eval()
    old = tmp_path / "old"
    enc.save_pretrained(old)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(old)
    save_file({k: v.contiguous() for k, v in m.classifier.state_dict().items()}, str(old / "dpft_head.safetensors"))
    (old / "dpft_head.json").write_text(json.dumps({"pooling": "mean", "num_labels": 3}))
    tok, loaded, kind = load_for_inference(old)
    e = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**e).logits, m(**e).logits, atol=1e-6, rtol=0)


def test_tracking_sends_only_released_quantities(tiny_model_dir, labelled_files, tmp_path, monkeypatch):
    """log.report_to: tensorboard (mocked: the package is an optional extra) gets ε, lr and dev/test
    metrics, never the training loss, batch size or clip fraction."""
    import sys
    import types

    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    rec = tiny_recipe(tiny_model_dir, labelled_files, **{
        "log.report_to": ["tensorboard"], "log.private_diagnostics": True, "eval.every_steps": 1,
        "task.test_file": str(labelled_files["test"])})
    Trainer(rec, tmp_path / "run", progress=False).run()
    tags = {c[0] for c in calls if len(c) == 3}
    assert {"epsilon", "lr", "dev_accuracy", "dev_loss", "test_accuracy", "test_loss"} <= tags
    assert not tags & {"train_loss", "batch_size", "clip_fraction", "step_seconds"}
    assert calls[0] == ("init", str(tmp_path / "run" / "tensorboard")) and calls[-1] == ("close",)
    from dpft.run.tracking import trackable

    assert trackable({"step": 1, "train_loss": 0.3, "batch_size": 9, "epsilon": 1.0, "dev_accuracy": 0.5,
                      "lr": 0.1, "clip_rate": 0.4}) == {"epsilon": 1.0, "dev_accuracy": 0.5, "lr": 0.1}
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "wandb", None)  # not installed
        from dpft.run.tracking import Trackers, TrackingError

        with pytest.raises(TrackingError, match="pip install wandb"):
            Trackers(["wandb"], tmp_path, "x", {})
