"""DP synthetic data for DP-SelFT: candidate generators and DP select-and-label."""
