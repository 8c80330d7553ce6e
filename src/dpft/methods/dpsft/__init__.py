"""DP-SFT (subspace fine-tuning): the method plug-in (method.py) and its private stage 1 (stage1.py)."""
