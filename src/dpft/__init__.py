"""dpft: differentially private fine-tuning of language models.

One engine (Poisson sampling -> per-example gradients -> clipping -> Gaussian noise ->
post-processing -> optimizer), one ledger of ``dp_accounting`` events per run, many recipes.
"""

__version__ = "0.1.0"
