"""Build the E2E training file of results/e2e_user_level.md: whole meaning representations
(MRs) drawn at random (seed 0) until 4,096 rows are reached, each row tagged with its MR's id
in a ``user`` column (one MR = one "user" with its several references).

Usage: python results/e2e_user_level_data.py SHARED_DATA_DIR OUT.csv
The file is derived from the shared E2E data and is not committed."""

import sys

import numpy as np
import pandas as pd

src, out = sys.argv[1], sys.argv[2]
df = pd.read_csv(f"{src}/e2e/trainset.csv")
mrs = df["mr"].drop_duplicates().to_numpy()
order = np.random.default_rng(0).permutation(len(mrs))
sizes = df.groupby("mr").size()
keep, rows = [], 0
for i in order:
    n = int(sizes[mrs[i]])
    if rows + n > 4096:
        continue
    keep.append(mrs[i])
    rows += n
    if rows == 4096:
        break
uid = {m: k for k, m in enumerate(keep)}
sub = df[df["mr"].isin(uid)].copy()
sub["user"] = sub["mr"].map(uid)
sub.to_csv(out, index=False)
print(f"{len(sub)} rows, {len(uid)} MRs (users); rows per MR: min {sub.groupby('user').size().min()}, "
      f"median {int(sub.groupby('user').size().median())}, max {sub.groupby('user').size().max()}")
