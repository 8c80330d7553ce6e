"""Layer (unit) selection for selective DP fine-tuning: perturbation-aware scoring on public
(DP synthetic) data, baseline selectors and the score cache."""
