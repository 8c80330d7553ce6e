"""A search's trials keep the task's class order (SST-5's 'very negative' = 0 …): before, the trials' files
task re-sorted the label names alphabetically, so the released model's ids disagreed with a test file's
integer labels (SST-5: 'negative' became 0)."""

from pathlib import Path

from dpft.config.recipe import Recipe, TaskCfg
from dpft.data.tasks import load_task

NAMES = ["very negative", "negative", "neutral", "positive", "very positive"]  # not sorted


def _files(tmp_path: Path) -> tuple[str, str]:
    rows = [("great", "very positive"), ("good", "positive"), ("fine", "neutral"), ("bad", "negative"),
            ("awful", "very negative")] * 3
    for name in ("train", "dev"):
        (tmp_path / f"{name}.tsv").write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    return str(tmp_path / "train.tsv"), str(tmp_path / "dev.tsv")


def test_files_task_label_names_fix_the_class_order(tmp_path):
    train, dev = _files(tmp_path)
    default = load_task(TaskCfg(name="files", train_file=train, dev_file=dev), seed=0)
    assert default.label_names == sorted(NAMES)  # strings: sorted, as documented
    given = load_task(TaskCfg(name="files", train_file=train, dev_file=dev, label_names=NAMES), seed=0)
    assert given.label_names == NAMES
    ids = dict(zip(given.train["text"], given.train["label"]))
    assert ids["awful"] == 0 and ids["great"] == 4 and ids["fine"] == 2


def test_trial_recipe_keeps_the_task_class_order(tmp_path):
    from dpft.run.tune import _trial_recipe

    train, dev = _files(tmp_path)
    r = Recipe.model_validate({"task": {"name": "sst5"}})
    t = _trial_recipe(r, {}, 1.0, Path(train), Path(dev), False, NAMES)
    assert t.task.name == "files" and t.task.label_names == NAMES
    data = load_task(t.task, seed=0)
    assert data.label_names == NAMES and dict(zip(data.train["text"], data.train["label"]))["awful"] == 0
