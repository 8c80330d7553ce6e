"""``dpft.PrivacyEngine().make_private`` (issue 15, item 4): the user's own loop, Opacus-shaped.

Checked: the clipped sums that reach the optimizer equal the torch.func reference engine's on
the same Poisson batches (so each example's contribution is within C), for a hand-written
module and a tiny Hugging Face BERT with peft LoRA; ε equals dp-accounting's for the steps
taken; Poisson batch sizes vary; noise is drawn once per logical batch (empty ones included);
what cannot be certified is refused.
"""

from __future__ import annotations

import math

import copy
import runpy
import warnings
from pathlib import Path

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from dpft.accounting.calibrate import CalibrationError
from dpft.api import DPDataLoader, DPOptimizer, PerExampleCriterion, PrivacyEngine
from dpft.grads.bookkeeping import UnattributedUseError
from dpft.grads.reference import ReferenceEngine
from dpft.step.clip import make_clip_policy
from dpft.step.noise import GaussianMechanism

ROOT = Path(__file__).resolve().parents[1]
V, T = 40, 6


class TinyNet(nn.Module):
    """Embedding + Linear + LayerNorm + mean-pool + Linear head."""

    def __init__(self, d=12, extra: nn.Module | None = None, outside_use=False):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.extra = extra
        self.head = nn.Linear(d, 3)
        self.outside_use = outside_use

    def forward(self, x):
        h = torch.tanh(self.fc(self.emb(x)))
        if self.extra is not None:
            h = self.extra(h)
        if self.outside_use:
            h = h + F.linear(h, self.fc.weight)
        return self.head(self.ln(h).mean(1))


class Gate(nn.Module):
    """A trainable module no book-keeping rule knows: y = x * g."""

    def __init__(self, d=12):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.g


def adversarial_data(n=30, seed=0):
    """Random tokens; every third example has its label flipped to a rare class and repeats one
    token (large, aligned gradients): the clip is active on every example at C = 0.05."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    x[::3] = 7
    y[::3] = 2
    return TensorDataset(x, y)


def ce_loss(forward, batch):
    return F.cross_entropy(forward(x=batch["x"]), batch["y"], reduction="none")


def run_and_compare(model, dataset, loss_fn, to_batch, forward, *, clipping="flat", C=0.05,
                    criterion=nn.CrossEntropyLoss(), phys=3, batch=8, epochs=1, ref_kwargs=None):
    """Train with make_private (σ = 0, SGD lr = 1) and check every logical update against the
    reference engine's clipped sum over the same examples, with the parameters before the step.

    Returns (engine, optimizer, logical batch sizes, micro-batch sizes, max per-example norm)."""
    n = len(dataset)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1.0)
    eng = PrivacyEngine(reproducible_seed=1)
    out = eng.make_private(module=model, optimizer=opt, criterion=criterion,
                           data_loader=DataLoader(dataset, batch_size=batch), noise_multiplier=0.0,
                           max_grad_norm=C, clipping=clipping, max_physical_batch_size=phys,
                           epochs=epochs)
    if criterion is None:
        module, dp_opt, loader = out
    else:
        module, dp_opt, crit, loader = out
    assert module is model and isinstance(dp_opt, DPOptimizer) and isinstance(loader, DPDataLoader)
    assert loader.sample_rate == pytest.approx(batch / n)
    qn = batch  # the update is divided by the expected batch size qN
    names = [n_ for n_, p in model.named_parameters() if p.requires_grad]
    sizes, micro, pending, snap, max_norm = [], [], [], None, 0.0
    for epoch in range(epochs):
        for mb in loader:
            if not pending:
                snap = copy.deepcopy(model)
                before = {n_: p.detach().clone() for n_, p in model.named_parameters() if p.requires_grad}
            pending.append(mb)
            micro.append(len(mb[0]))
            dp_opt.zero_grad()
            last = dp_opt.is_last_micro_batch
            logits = forward(module, mb)
            if criterion is None:
                loss = F.cross_entropy(logits, mb[-1])  # a plain batch mean
            else:
                loss = crit(logits, mb[-1])
            loss.backward()
            for p in model.parameters():
                assert p.grad is None  # the hooks never leave a non-private gradient
            applied = dp_opt.step()
            assert applied == last
            if not applied:
                continue
            full = to_batch([torch.cat(parts) for parts in zip(*pending)])
            sizes.append(len(full[next(iter(full))]))
            pending = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref_engine = ReferenceEngine(snap, loss_fn, make_clip_policy(clipping, C))
                per_ex, _ = ref_engine.per_example_grads(full)
                ref = ref_engine._finish(per_ex, 0.0)
            max_norm = max(max_norm, float(ref.norms.max()))
            contrib = (ref.scales[:, :, None] ** 2 * torch.stack(
                [per_ex[n_].reshape(len(ref.scales), -1).pow(2).sum(1) for n_ in ref_engine.param_names],
                1)[:, :, None]).sum((1, 2)).sqrt()
            assert float(contrib.max()) <= C * (1 + 1e-5)  # every example within C
            after = dict(model.named_parameters())
            for name in names:
                upd = (before[name] - after[name].detach()) * qn
                g = ref.grad_sum[name]
                # float32 parameters: the update is read back as a difference of values ~|θ|
                atol = qn * 1e-6 * max(1.0, float(before[name].abs().max()))
                torch.testing.assert_close(upd, g, rtol=1e-4, atol=atol, msg=name)
    assert not pending
    return eng, dp_opt, sizes, micro, max_norm


def tiny_to_batch(parts):
    return {"x": parts[0], "y": parts[1]}


def tiny_forward(module, mb):
    return module(mb[0])


# ----------------------------------------------------------------------------- (a) hand-written module


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_handwritten_module_equals_reference_engine(clipping):
    torch.manual_seed(0)
    model = TinyNet()
    eng, opt, sizes, micro, max_norm = run_and_compare(
        model, adversarial_data(), ce_loss, tiny_to_batch, tiny_forward, clipping=clipping, epochs=2)
    assert max_norm > 10 * 0.05  # the clip was active (adversarial examples)
    assert max(micro) <= 3
    # one rule in every way in (step/plan.planned_steps): ⌈epochs · N / B⌉ = ⌈60 / 8⌉, as dpft train and DPTrainer
    assert opt.logical_steps == eng.ledger.steps == math.ceil(2 * 30 / 8)
    assert len(set(sizes)) > 1  # Poisson: the logical batch size varies


def test_sum_criterion_and_plain_mean_loss_give_the_same_clipped_sums():
    torch.manual_seed(0)
    run_and_compare(TinyNet(), adversarial_data(), ce_loss, tiny_to_batch, tiny_forward,
                    criterion=nn.CrossEntropyLoss(reduction="sum"))
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="loss_reduction='mean'"):
        run_and_compare(TinyNet(), adversarial_data(), ce_loss, tiny_to_batch, tiny_forward, criterion=None)


def test_module_without_rule_falls_back_with_warning_and_stays_exact():
    torch.manual_seed(0)
    model = TinyNet(extra=Gate())
    with pytest.warns(UserWarning, match="Gate"):
        run_and_compare(model, adversarial_data(18), ce_loss, tiny_to_batch, tiny_forward)


class RootScaled(TinyNet):
    """The root module owns a parameter (a unit without a rule: the fallback re-runs the root)."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return super().forward(x) * self.temperature


def test_root_module_with_its_own_parameter_falls_back_exactly():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="RootScaled"):
        run_and_compare(RootScaled(), adversarial_data(12), ce_loss, tiny_to_batch, tiny_forward, batch=6)


def test_parameter_used_outside_its_module_is_refused_on_the_first_batch():
    torch.manual_seed(0)
    model = TinyNet(outside_use=True)
    eng = PrivacyEngine(reproducible_seed=0)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(adversarial_data(), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0)
    x, y = next(iter(loader))
    with pytest.raises(UnattributedUseError, match="fc.weight"):
        crit(module(x), y)


# ----------------------------------------------------------------------------- (b) HF BERT + LoRA


def tiny_bert_lora():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=3)
    base = transformers.AutoModelForSequenceClassification.from_config(cfg)
    lcfg = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["query", "value"])
    model = peft.get_peft_model(base, lcfg).eval()
    for n, p in model.named_parameters():  # LoRA weights start at B = 0: make them non-trivial
        if "lora_B" in n:
            nn.init.normal_(p, std=0.5)
    return model


def bert_data(n=24):
    ds = adversarial_data(n)
    x, y = ds.tensors
    mask = torch.ones_like(x)
    mask[1::4, T - 2:] = 0
    x = x.masked_fill(mask == 0, 0)
    return TensorDataset(x, mask, y)


def bert_loss(forward, batch):
    from dpft.models.losses import classification_loss

    return classification_loss(forward, batch)


def bert_to_batch(parts):
    return {"input_ids": parts[0], "attention_mask": parts[1], "labels": parts[2]}


def bert_forward(module, mb):
    return module(input_ids=mb[0], attention_mask=mb[1]).logits


def test_hf_bert_lora_equals_reference_engine():
    model = tiny_bert_lora()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("classifier" in n for n in trainable)
    eng, opt, sizes, micro, max_norm = run_and_compare(
        model, bert_data(), bert_loss, bert_to_batch, bert_forward, C=0.05, phys=4, batch=6)
    assert max_norm > 0.05 and max(micro) <= 4
    assert opt.logical_steps == eng.ledger.steps == 4


# ----------------------------------------------------------------------------- accounting, noise


def pld_epsilon(q, sigma, steps, delta):
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def train(module, opt, crit, loader, epochs, forward=tiny_forward):
    sizes, n_true = [], 0
    for _ in range(epochs):
        cur = 0
        for mb in loader:
            opt.zero_grad()
            crit(forward(module, mb), mb[-1]).backward()
            cur += len(mb[0])
            if opt.step():
                n_true += 1
                sizes.append(cur)
                cur = 0
    return sizes, n_true


def test_epsilon_equals_dp_accounting_and_noise_once_per_logical_batch(monkeypatch):
    calls = []
    real = GaussianMechanism.add_noise
    monkeypatch.setattr(GaussianMechanism, "add_noise", lambda self, s, t: calls.append(t) or real(self, s, t))
    torch.manual_seed(0)
    model = TinyNet()
    n, b, sigma, delta = 40, 2, 0.9, 1e-3  # q = 1/20: some logical batches are empty
    eng = PrivacyEngine(reproducible_seed=3)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(adversarial_data(n), batch_size=b, shuffle=True), noise_multiplier=sigma,
        max_grad_norm=1.0, steps=30, max_physical_batch_size=1)
    assert len(loader) == math.ceil(n / b)
    sizes, n_true = train(module, opt, crit, loader, epochs=2)
    assert eng.ledger.steps == opt.logical_steps == len(calls) == 30  # capped at the planned steps
    assert calls == sorted(set(calls))  # one draw per logical step, never a stream twice
    assert n_true < 30  # the empty logical batches were released too (pure noise)
    assert len(set(sizes)) > 1
    assert eng.get_epsilon(delta) == pytest.approx(pld_epsilon(b / n, sigma, 30, delta), rel=1e-9)
    with pytest.warns(UserWarning, match="planned"):
        assert list(loader) == []  # the budget is spent: nothing more is drawn
    assert eng.ledger.steps == 30


def test_target_epsilon_is_met_after_the_planned_epochs():
    torch.manual_seed(0)
    model = TinyNet()
    n, b, delta = 30, 6, 1e-3
    eng = PrivacyEngine(reproducible_seed=0)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(adversarial_data(n), batch_size=b), target_epsilon=4.0, target_delta=delta,
        epochs=2, max_grad_norm=1.0)
    train(module, opt, crit, loader, epochs=2)
    eps = eng.get_epsilon(delta)
    assert eng.ledger.steps == 2 * (n // b)
    assert 0.97 * 4.0 <= eps <= 4.0
    assert eps == pytest.approx(pld_epsilon(b / n, eng.noise_multiplier, eng.ledger.steps, delta), rel=1e-9)


def test_same_seed_same_updates_secret_seed_differs():
    def one(seed):
        torch.manual_seed(0)
        model = TinyNet()
        eng = PrivacyEngine(reproducible_seed=seed) if seed is not None else PrivacyEngine()
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(adversarial_data(), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
            steps=2)
        train(module, opt, crit, loader, epochs=1)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(one(5), one(5))
    assert not torch.equal(one(None), one(None))


# ----------------------------------------------------------------------------- refusals


def make(**kw):
    torch.manual_seed(0)
    model = kw.pop("model", None) or TinyNet()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(adversarial_data(), batch_size=8),
                max_grad_norm=1.0, noise_multiplier=1.0)
    args.update(kw)
    return PrivacyEngine(reproducible_seed=0).make_private(**args)


class Stream(IterableDataset):
    def __iter__(self):
        yield from adversarial_data()


def test_refusals():
    ds = adversarial_data()
    with pytest.raises(ValueError, match="not both"):
        make(epochs=1, steps=3)
    with pytest.raises(ValueError, match="exactly one of target_epsilon"):
        make(target_epsilon=1.0, target_delta=1e-3, epochs=1)
    with pytest.raises(ValueError, match="needs epochs or steps"):
        make(noise_multiplier=None, target_epsilon=1.0, target_delta=1e-3)
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        make(data_loader=DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler([1.0] * len(ds), 10)))
    with pytest.raises(ValueError, match="IterableDataset"):
        make(data_loader=None, dataset=Stream(), expected_batch_size=4)
    with pytest.raises(ValueError, match="exactly one of data_loader and dataset"):
        make(dataset=ds)
    with pytest.raises(ValueError, match="Poisson"):
        make(poisson_sampling=False)
    with pytest.raises(CalibrationError, match="cannot be met"):
        make(noise_multiplier=None, target_epsilon=1e-3, target_delta=1e-3, epochs=50)
    with pytest.raises(CalibrationError, match="1/N"):
        make(noise_multiplier=None, target_epsilon=1.0, target_delta=0.1, epochs=1)
    with pytest.raises(ValueError, match="per-example"):
        make(criterion=lambda out, y: F.cross_entropy(out, y))
    with pytest.raises(ValueError, match="reduction='none'"):
        make(criterion=nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match="BatchNorm"):
        make(model=TinyNet(extra=nn.BatchNorm1d(T)))
    other = nn.Linear(2, 2)
    model = TinyNet()
    with pytest.raises(ValueError, match="not parameters of module"):
        make(model=model, optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))
    with pytest.raises(ValueError, match="clipping"):
        make(clipping="head_body")
    module, opt, crit, loader = make()
    with pytest.raises(ValueError, match="already private"):
        make(model=module)
    with pytest.raises(RuntimeError, match="outside a micro-batch"):
        opt.step()


def test_dataset_argument_and_criterion_shapes():
    torch.manual_seed(0)
    model = TinyNet()
    eng = PrivacyEngine(reproducible_seed=0)
    module, opt, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=adversarial_data(),
        expected_batch_size=5, noise_multiplier=1.0, max_grad_norm=1.0, steps=2)
    assert loader.expected_batch_size == 5 and loader.sample_rate == pytest.approx(5 / 30)
    # Sequence losses reduce each example's own elements; ignore_index positions do not count.
    crit = PerExampleCriterion(nn.CrossEntropyLoss(ignore_index=-100))
    logits = torch.randn(2, 3, 4, requires_grad=True)
    tgt = torch.tensor([[0, 1, -100, -100], [2, 2, 1, 0]])
    per = crit.per_example(logits, tgt)
    full = F.cross_entropy(logits, tgt, reduction="none", ignore_index=-100)
    torch.testing.assert_close(per, torch.stack([full[0, :2].mean(), full[1].mean()]))
    loss = crit(logits, tgt)
    loss.backward()
    g_mean = logits.grad.clone()
    logits.grad = None
    per.sum().backward()  # the mean criterion's gradient is that of the sum: each example's own
    torch.testing.assert_close(g_mean, logits.grad)


# ----------------------------------------------------------------------------- the README snippet


def test_readme_snippet_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "snippets" / "from_python.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "ε =" in out


def test_readme_from_python_section_is_the_snippet():
    """The README's "From Python" example is exactly the file the test above runs."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (ROOT / "docs" / "snippets" / "from_python.py").read_text()
