"""Issue 34 item 1: a way in is cheap on the plan — ``privatize_trainer`` makes transformers'
``Seq2SeqTrainer`` private through DPTrainer's plan (same ledger and σ as DPTrainer for the same
settings), and refuses by name trainers whose loss is not a sum of per-example terms."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer

from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.integrations.hf.privatize import privatize_trainer


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg).train()


def _rows(n=24):
    import datasets

    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 64, (n, 6), generator=g)
    tgt = torch.randint(3, 64, (n, 4), generator=g)
    return datasets.Dataset.from_dict({"input_ids": src.tolist(), "attention_mask": torch.ones(n, 6).long().tolist(),
                                       "labels": tgt.tolist()})


def test_privatized_seq2seq_trainer_trains_through_the_plan(tmp_path):
    DPSeq2Seq = privatize_trainer(Seq2SeqTrainer)
    assert DPSeq2Seq.__name__ == "DPSeq2SeqTrainer" and issubclass(DPSeq2Seq, DPTrainer)
    assert issubclass(DPSeq2Seq, Seq2SeqTrainer) and DPSeq2Seq.training_step is DPTrainer.training_step
    assert DPSeq2Seq.prediction_step is Seq2SeqTrainer.prediction_step  # the subclass's own parts are kept

    model = _bart()

    def collate(feats):  # what DataCollatorForSeq2Seq(tokenizer, model=model) gives for equal-length rows
        batch = {k: torch.tensor([f[k] for f in feats]) for k in feats[0]}
        batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return batch

    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1e-2, report_to=[], use_cpu=True,
                                    per_device_train_batch_size=8, max_steps=3, save_strategy="no",
                                    disable_tqdm=True, logging_steps=100)
    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=6, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPSeq2Seq(model=model, args=args, train_dataset=_rows(),
                       data_collator=collate, dp_args=dp)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        tr.train()
    assert tr.ledger.steps == 3 and tr.get_epsilon() <= 4.0 + 1e-6
    assert tr.plan.sigma == tr.sigma and tr.plan.n == 24 and tr.plan.q == pytest.approx(6 / 24)
    assert any(not torch.equal(before[k], p) for k, p in model.named_parameters())


def test_privatize_refuses_by_name_and_overrides():
    class KTOTrainer(Trainer):  # stands in for trl.KTOTrainer: refused by its name anywhere in the MRO
        pass

    with pytest.raises(ValueError, match="KTO's loss subtracts a KL reference point"):
        privatize_trainer(type("MyKTO", (KTOTrainer,), {}))

    class OwnSampler(Trainer):
        def _get_train_sampler(self, *a, **k):
            return None

    with pytest.raises(ValueError, match="overrides _get_train_sampler"):
        privatize_trainer(OwnSampler)
    with pytest.raises(TypeError, match="not a transformers.Trainer subclass"):
        privatize_trainer(int)
    assert privatize_trainer(DPTrainer) is DPTrainer

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, **kw):
            return model(**inputs).loss

    with pytest.raises(ValueError, match="compute_loss returns one loss for the batch"):
        privatize_trainer(OwnLoss)(model=torch.nn.Linear(2, 2), dp_args=DPArguments(
            target_epsilon=1.0, target_delta=1e-3, expected_batch_size=2))
