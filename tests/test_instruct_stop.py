"""Issue 36 item 9: instruction tuning that learns to stop.

- every instruct path checks that each complete completion ends in a token generation stops at
  (EOS, or a chat template's end of turn) among its *targets*, and refuses data that would never
  teach the model to stop (a tokenizer without EOS; TRL-prepared rows without it);
- generation (dev scoring, the saved model's generation config, ``dpft predict``) stops at the end
  of turn the data taught (ChatML ``<|im_end|>`` where the tokenizer's EOS is ``</s>``);
- ``dpft predict`` and the report warn when every generation is the same text;
- the CLI's final summary of an instruct run gives exact match and ROUGE-L.

Tiny random Llama models and the word-level tokenizer of test_instruct.py, built in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dpft.config.recipe import TaskCfg
from dpft.data.instruct import load_instruct_task
from dpft.data.stop import (check_prepared_rows, identical_generations, learned_stop_ids, set_generation_stop)
from dpft.data.tasks import DataError
from test_instruct import CHATML, ROOT, _tiny_model_dir, _write_jsonl, tiny_llama, tiny_tokenizer

transformers = pytest.importorskip("transformers")

ROWS = [{"prompt": f"my {w} is slow", "completion": f"restart the {w}"} for w in ("router", "phone", "shop", "pub")]


def _no_eos_tokenizer():
    tok = tiny_tokenizer()
    tok.eos_token = None
    assert tok.eos_token_id is None
    return tok


def test_a_tokenizer_without_eos_is_refused_with_the_fix(tmp_path):
    """Simple template, prompt/completion rows, no EOS: the completions cannot end; before, the run
    trained and its generations never stopped."""
    f = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    cfg = TaskCfg(name="instruct", train_file=str(f), dev_file=str(f), prompt_column="prompt",
                  completion_column="completion")
    with pytest.raises(DataError, match=r"4 of 4 complete rows have no end-of-sequence token.*never learns to "
                                         r"stop.*no eos_token: set one") as e:
        load_instruct_task(cfg, _no_eos_tokenizer(), 32)
    assert "restart" not in str(e.value) and "router" not in str(e.value)  # no row is quoted
    # with EOS the completions end in it: EOS is what generation stops at
    tok = tiny_tokenizer()
    assert load_instruct_task(cfg, tok, 32).stop_ids == [tok.eos_token_id]


def test_chat_template_end_of_turn_is_the_learned_stop_and_generation_stops_there(tmp_path):
    """ChatML turns end in <|im_end|> while the tokenizer's EOS is </s>: the data teaches
    <|im_end|>, so dev generation and the saved generation config stop there too."""
    tok = tiny_tokenizer(CHATML)
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in ROWS]
    f = _write_jsonl(tmp_path / "c.jsonl", rows)
    data = load_instruct_task(TaskCfg(name="instruct", train_file=str(f), dev_file=str(f)), tok, 32)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert data.template == "chat" and data.stop_ids == [end]
    model = tiny_llama(len(tok))
    set_generation_stop(model, data.stop_ids)
    assert end in model.generation_config.eos_token_id and tok.eos_token_id in model.generation_config.eos_token_id
    # a model that always says <|im_end|>: generation ends at it (before, it ran to max_new_tokens)
    from dpft.eval.generate import generate_ids, generation_eval

    with torch.no_grad():
        model.lm_head.weight.zero_()
    bias = torch.zeros(len(tok))
    bias[end] = 1.0
    model.lm_head.register_forward_hook(lambda m, a, out: out + bias)
    prompts = [g["prompt_ids"] for g in data.groups]
    assert generate_ids(model, prompts, tok.pad_token_id, tok.eos_token_id, max_new_tokens=5) == [[end] * 5] * 4
    assert generate_ids(model, prompts, tok.pad_token_id, [tok.eos_token_id, *data.stop_ids], max_new_tokens=5) == [[]] * 4
    g = generation_eval(model, tok, data.groups, max_new_tokens=5, stop_ids=data.stop_ids)
    assert g["metrics"]["dev_generated"] == 4 and g["metrics"]["dev_distinct_generations"] == 1
    assert g["warning"].startswith("all 4 generations are the same text")


def test_prepared_trl_rows_without_eos_in_the_completion_are_refused():
    """The check DPSFTTrainer runs on TRL's prepared rows (input_ids + completion_mask)."""
    import datasets

    tok = tiny_tokenizer()
    ids = [tok.convert_tokens_to_ids(t.split()) for t in ("<s> my router is slow restart it", "<s> hello thanks")]
    masks = [[0, 0, 0, 0, 0, 1, 1], [0, 1, 1]]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": masks})
    with pytest.raises(DataError, match=r"DPSFTTrainer train_dataset: 2 of 2 complete rows have no end-of-sequence"):
        check_prepared_rows(ds, tok)
    eos = tok.eos_token_id
    ok = datasets.Dataset.from_dict({"input_ids": [x + [eos] for x in ids], "completion_mask": [m + [1] for m in masks]})
    assert check_prepared_rows(ok, tok) == [eos]
    # a row cut at max_length lost its end legitimately and is not held against the data
    cut = datasets.Dataset.from_dict({"input_ids": [ids[1] + [eos], ids[0]], "completion_mask": [masks[1] + [1], masks[0]]})
    assert check_prepared_rows(cut, tok, max_length=len(ids[0])) == [eos]
    with pytest.raises(DataError, match="1 of 2 complete rows"):
        check_prepared_rows(cut, tok)
    # labels (-100 outside the completion) are read the same way
    assert learned_stop_ids([{"input_ids": ids[1] + [eos], "labels": [-100, *ids[1][1:], eos]}], tok, "x") == [eos]
    with pytest.raises(DataError, match="1 of 1 complete rows"):
        learned_stop_ids([{"input_ids": ids[1] + [eos], "labels": [-100, *ids[1][1:], -100]}], tok, "x")


def test_identical_generations_warning():
    assert identical_generations(["same", " same ", "same"]).startswith("all 3 generations are the same text")
    assert identical_generations(["one", "two"]) is None and identical_generations(["alone"]) is None


def _constant_run(tmp_path: Path) -> Path:
    """A finished-looking instruct run folder whose model always answers with padding (the same
    empty text for every prompt)."""
    run = tmp_path / "run"
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: greedy picks id 0 (<pad>) for every prompt
    model.save_pretrained(run / "model")
    tok.save_pretrained(run / "model")
    shutil.copy(ROOT / "examples/chat-support/recipe.yaml", run / "recipe.yaml")
    return run


def test_predict_warns_when_every_generation_is_the_same(tmp_path, capsys):
    from dpft.run.predict import predict

    run = _constant_run(tmp_path)
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("my router is slow", "hello")))
    out = predict(run, f, max_new_tokens=3, progress=False)
    assert out["kind"] == "causal_lm" and out["n"] == 2
    assert out["warning"].startswith("all 2 generations are the same text")
    assert "WARNING: all 2 generations are the same text" in capsys.readouterr().err


def test_cli_summary_of_an_instruct_run_gives_exact_match_and_rouge_l(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, [
        "train", "examples/chat-support/recipe.yaml", "--no-dp", "--quiet", "-o", str(tmp_path / "run"),
        "--model", str(_tiny_model_dir(tmp_path)), "--steps", "1", "--set", "task.max_train_examples=8",
        "--set", "batch.expected_batch_size=8", "--set", "model.max_length=32", "--set", "eval.max_new_tokens=2",
        "--set", "eval.max_generate_prompts=3"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    m = rep["metrics"]
    line = next(x for x in res.output.splitlines() if x.startswith("dev generation:"))
    assert f"exact match {m['dev_exact_match']:.1f} %" in line and f"ROUGE-L F {m['dev_rouge_l']:.2f}" in line
    assert "(3 prompts, greedy)" in line
    # the summary's warning and the report's agree on whether every generation was the same text
    assert ("WARNING: all 3 generations" in res.output) == ("warning" in rep["generation"])
    if "warning" in rep["generation"]:
        assert "**Warning:** all 3 generations" in (tmp_path / "run" / "report.md").read_text()
    gen_cfg = json.loads((tmp_path / "run" / "model" / "generation_config.json").read_text())
    eos = gen_cfg["eos_token_id"]
    assert tiny_tokenizer().eos_token_id in ([eos] if isinstance(eos, int) else eos)


def test_trl_chat_rows_end_in_the_turn_marker_that_generation_must_stop_at(tmp_path):
    """What DPSFTTrainer hits (issue 36 item 9): TRL renders ChatML turns ending in <|im_end|> (a
    target) while the model's generation config stops only at </s>, so generations never end.
    ``check_prepared_rows`` on TRL's prepared rows finds <|im_end|>; ``set_generation_stop`` makes
    generation (and the saved generation_config.json) stop there."""
    import datasets

    trl = pytest.importorskip("trl")
    tok = tiny_tokenizer(CHATML)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in ROWS]
    model = tiny_llama(len(tok))
    t = trl.SFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(tmp_path / "out"), max_length=40, report_to=[],
                                                       use_cpu=True),
                       train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen_eos = t.model.generation_config.eos_token_id
    assert end not in ([gen_eos] if isinstance(gen_eos, int) else gen_eos)  # the bug: never stops at the turn end
    stop = check_prepared_rows(t.train_dataset, tok, max_length=40)
    assert stop == [end]
    set_generation_stop(t.model, stop)
    assert end in t.model.generation_config.eos_token_id
    t.model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())["eos_token_id"]
    assert end in saved
