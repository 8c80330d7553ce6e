"""EW-FT / DP-Forward (forward-pass LDP): the method plug-in and its parts, FSDP2 and train_pre phases, the split deployment."""
