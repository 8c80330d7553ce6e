"""``PrivacyEngine().make_private(...)``: DP training inside the user's own PyTorch loop.

Opacus-shaped (Opacus ``PrivacyEngine.make_private`` / ``make_private_with_epsilon``; Yousefpour
et al. 2021), so that an Opacus user switches by changing one import::

    from dpft import PrivacyEngine          # was: from opacus import PrivacyEngine

    engine = PrivacyEngine()                # secret randomness; PrivacyEngine(reproducible_seed=0) in tests
    module, optimizer, criterion, data_loader = engine.make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(ds, batch_size=64),
        target_epsilon=3.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0,
        max_physical_batch_size=32)
    for epoch in range(3):
        for x, y in data_loader:            # Poisson logical batches, in micro-batches of <= 32
            optimizer.zero_grad()
            loss = criterion(module(x), y)
            loss.backward()
            optimizer.step()                # True when the noisy update was applied
    print(engine.get_epsilon(1e-5), engine.ledger)

What each object does (DESIGN.md "The DP step, as data flows"; Abadi et al. 2016, DP-SGD,
Algorithm 1, with Poisson sampling and the book-keeping per-example engine of Bu et al. 2023):

* the **data loader** draws each logical batch by Poisson sampling: every one of the N
  examples joins step t independently with probability q = expected batch / N (expected batch
  = the user's loader ``batch_size`` unless ``expected_batch_size`` is given; N =
  ``len(dataset)``). It yields the logical batch as physical micro-batches of at most
  ``max_physical_batch_size`` examples (Opacus' ``BatchMemoryManager``). ``len(data_loader)``
  is the number of logical steps per epoch, ``N // expected batch``. An empty logical batch
  yields nothing, but its noisy update (pure noise) is still applied and recorded, when the
  next micro-batch is requested;
* the **module** is the user's own module with hooks (not a wrapper): a training forward (grad
  enabled) records each trainable layer's input and the user's ``loss.backward()`` its output
  gradient; from these the per-example gradient norms and the clipped sum ``Σᵢ cᵢgᵢ`` are
  computed (one forward, one backward; ``dpft.grads.live``). ``p.grad`` is never the
  non-private gradient when the optimizer steps. Any ``nn.Module`` made of layers with a
  book-keeping rule works (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, RMSNorm, GPT-2
  ``Conv1D``, peft LoRA, and whatever is registered with ``dpft.grads.registry.register_layer``);
  a trainable module without a rule gets exact per-example gradients via ``torch.func`` with a
  warning naming its class;
* the **criterion** gives per-example losses: it is the user's loss with ``reduction='none'``,
  each example's elements averaged (``'mean'``) or summed (``'sum'``, ``'batchmean'``); it
  returns their mean (or sum) over the micro-batch, whose gradient reaches each example's loss
  unscaled (a mean's ``1/B`` is scaled back), so each example's gradient is its own;
* the **optimizer** wraps the user's: ``step()`` adds the micro-batch's clipped sum to the
  logical batch's and returns ``False``, except after the *last* micro-batch of a logical batch,
  where it runs the project's DP step once (``dpft.step.DPStep.release_and_update``: Gaussian
  noise N(0, σ²C²) on the sum, one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` in the
  ledger, division by the expected batch size qN, then the user's optimizer) and returns
  ``True``. Before calling it, ``optimizer.is_last_micro_batch`` says which it will be;
  ``optimizer.logical_steps`` counts the noisy updates, ``optimizer.last_step`` holds the last
  :class:`~dpft.step.StepOutput`. Step an LR scheduler with ``if optimizer.step():
  scheduler.step()``.

Device and precision: move the module to its device before ``make_private`` (or after; nothing is
moved to the CPU): the clipped sums are accumulated in fp32 on each parameter's device and the
noise is drawn there from a generator of that device seeded by the secret randomness. Batches
come from the user's collate function, so move them as usual (``x.to(device)``). bf16 autocast
around the forward works (norms and sums stay fp32); fp16 with ``torch.amp.GradScaler`` does not
(``dpft.grads.live``). Activation checkpointing works with the module's hooks.

One capture per micro-batch: a second forward+backward on the same micro-batch before
``optimizer.step()`` raises :class:`DoubleCaptureError` (each pass would be clipped on its own and
the example counted twice; sum the losses and call backward once). An optimizer parameter that
the engine does not clip (frozen at ``make_private``) only warns while frozen; with a gradient,
``step()`` raises :class:`UnclippedParameterError` before anything is released. A collated batch
must hold one row per sampled example (:func:`check_unpacked_batch`; packing collators raise
:class:`PackedBatchError`).

Real models: a pretrained encoder with a fresh head learns with ``clipping="head_body"`` and the
head in its own optimizer param group at a far larger learning rate (param groups' ``lr`` are
honoured; ``clipping="per_group"`` clips each group to C·√``clip_fraction``); flat clipping with
one learning rate ends at the majority class. README "From Python" and
docs/snippets/sst2_make_private.py; :func:`prediction_summary` warns on a constant classifier.

``engine.ledger`` is the :class:`~dpft.accounting.ledger.PrivacyLedger` the CLI uses (PLD of
``dp-accounting``); ``engine.get_epsilon(delta)`` is its ε. With a target ε the loader yields no
more than the planned number of logical steps (``epochs × len(data_loader)`` or ``steps``), so
the target is never exceeded; with an explicit ``noise_multiplier`` and no plan it never stops,
and ε is whatever the ledger says.

Several processes and user level: under ``torchrun`` the world runs one DP-SGD (rank 0's broadcast
key, one Poisson logical batch for the world, each rank's ``DPDataLoader`` yielding its share, one
all-reduce of clipped sums per logical step, noise once for the world, the ledger of one
process; a ``DistributedDataParallel``-wrapped module is refused); ``user_ids=`` makes the privacy
unit a user (q and N count users, at most ``max_rows_per_user`` rows per sampled user, the user's
summed gradient clipped to C). :meth:`PrivacyEngine.make_private` and
docs/make_private_distributed.md.

Files: ``engine.py`` (:class:`PrivacyEngine`), ``loader.py`` (:class:`DPDataLoader`),
``criterion.py`` (:class:`PerExampleCriterion`), ``optimizer.py`` (:class:`DPOptimizer`),
``clipping.py`` (``head_body`` by parameters or names, ``per_group``: make_private's keywords for the
one clip builder, step/clip.py), ``guards.py`` (packing, unclipped
parameters, one-class predictions).
"""

from dpft.api.clipping import CLIPPING_STYLES
from dpft.api.criterion import PerExampleCriterion
from dpft.api.engine import PrivacyEngine
from dpft.api.guards import (
                             PACKING_KEYS,
                             PackedBatchError,
                             UnclippedParameterError,
                             check_unpacked_batch,
                             prediction_summary,
)
from dpft.api.loader import DPDataLoader
from dpft.api.optimizer import DPOptimizer
from dpft.grads.live import DoubleCaptureError
from dpft.step.clip import GroupClip

__all__ = ["PrivacyEngine", "DPOptimizer", "DPDataLoader", "PerExampleCriterion", "GroupClip",
           "PackedBatchError", "DoubleCaptureError", "UnclippedParameterError", "prediction_summary",
           "check_unpacked_batch", "CLIPPING_STYLES", "PACKING_KEYS"]
