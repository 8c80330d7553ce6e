"""Keyed fingerprints of the training rows' *content*, carried by a run's saved secret state.

A resumed stateful mechanism (banded MF's secret partition, step/correlated.py) is restored by
row index: the same N rows in another order (a dataset shuffled without a seed, a re-exported
file) would put examples into other partitions, so they could participate fewer than b steps
apart and the recorded participations would no longer bound ε (Choquette-Choo et al. 2023,
Theorem 4 needs b-min-separation of every example). Checking N alone misses this; the state
therefore carries a fingerprint of the rows' content, in order and as a multiset, and every way
in refuses a resume whose rows differ (other rows) or are reordered (same rows, other order).

Keyed: each fingerprint is BLAKE2b-256 keyed with a fresh 128-bit salt from the OS CSPRNG that
travels with it, so the saved digest cannot be checked against guessed rows without the (secret,
owner-only) state file. Rows are canonicalised so that a tensor, a NumPy array and a list of the
same numbers hash alike (a ``datasets.Dataset`` formatted for torch on one run and for Python on
the next is the same data).
"""

from __future__ import annotations

import hashlib
import pickle
import secrets
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["rows_fingerprint", "check_rows", "RowsMismatch"]

_FORMAT = "dpft-rows-v1"


class RowsMismatch(ValueError):
    """The rows of a resume are not the rows the saved state was written for."""


def _canon(x: Any, out: list) -> None:
    if hasattr(x, "detach") and hasattr(x, "tolist"):  # torch tensor
        x = x.detach().cpu().tolist()
    elif hasattr(x, "tolist") and hasattr(x, "dtype"):  # numpy array or scalar
        x = x.tolist()
    if isinstance(x, Mapping):
        out.append(b"M%d" % len(x))
        for k in sorted(x, key=str):
            _canon(str(k), out)
            _canon(x[k], out)
    elif isinstance(x, (list, tuple)):
        out.append(b"L%d" % len(x))
        for v in x:
            _canon(v, out)
    elif isinstance(x, str):
        b = x.encode("utf-8")
        out.append(b"S%d:" % len(b) + b)
    elif isinstance(x, (bytes, bytearray)):
        out.append(b"B%d:" % len(x) + bytes(x))
    elif x is None or isinstance(x, (bool, int, float)):
        out.append(b"P" + repr(x).encode())
    else:  # an object of the user's: its pickle (deterministic for plain data classes)
        b = pickle.dumps(x, protocol=4)
        out.append(b"O%d:" % len(b) + b)


def _row_digest(row: Any) -> bytes:
    parts: list = []
    _canon(row, parts)
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def _iter_rows(rows):
    """Every row of ``rows`` in index order: a ``datasets.Dataset`` in batches (fast), any other
    map-style dataset or sequence by index."""
    it = getattr(rows, "iter", None)
    cols = getattr(rows, "column_names", None)
    if callable(it) and cols is not None:
        for batch in it(batch_size=1024):
            k = len(batch[cols[0]]) if cols else 0
            for i in range(k):
                yield {c: batch[c][i] for c in cols}
        return
    for i in range(len(rows)):
        yield rows[i]


def rows_fingerprint(rows, salt: Optional[bytes] = None) -> dict:
    """The keyed fingerprint of ``rows`` (a map-style dataset, ``datasets.Dataset`` or sequence).

    Args:
        rows: the training rows in the order the sampler indexes them (N = ``len(rows)``).
        salt: 16 bytes (default: fresh from the OS CSPRNG); pass the saved salt to compare.

    Returns:
        ``{"format", "n", "salt" (hex), "ordered" (hex), "multiset" (hex)}``: BLAKE2b-256 keyed
        with the salt of the rows' content digests in order, and sorted (order-free).
    """
    salt = secrets.token_bytes(16) if salt is None else bytes(salt)
    digests = [_row_digest(r) for r in _iter_rows(rows)]
    ordered = hashlib.blake2b(b"".join(digests), key=salt, digest_size=32, person=b"dpft-rows-ord").hexdigest()
    multiset = hashlib.blake2b(b"".join(sorted(digests)), key=salt, digest_size=32,
                               person=b"dpft-rows-set").hexdigest()
    return {"format": _FORMAT, "n": len(digests), "salt": salt.hex(), "ordered": ordered, "multiset": multiset}


def check_rows(saved: Optional[dict], rows, where: str, fix: str) -> None:
    """Refuse ``rows`` unless they are, in order, the rows ``saved`` was computed on.

    Args:
        saved: :func:`rows_fingerprint` of the rows the state was written for (None: a state
            written without one, refused too — its rows cannot be checked).
        where: the way in's resume call, for the message (``--resume``, ``load_noise_state``).
        fix: what to do instead (start anew: the ledger keeps what was spent).

    Raises:
        RowsMismatch: no fingerprint, other rows, or the same rows reordered — each naming the fix.
    """
    if not saved or saved.get("format") != _FORMAT:
        raise RowsMismatch(f"{where}: the saved state carries no fingerprint of its training rows (written by an "
                           f"older dpft), so a reordered or different dataset could not be told apart; {fix}")
    now = rows_fingerprint(rows, bytes.fromhex(saved["salt"]))
    if now["ordered"] == saved["ordered"]:
        return
    if now["multiset"] == saved["multiset"]:
        raise RowsMismatch(f"{where}: these are the same {now['n']} training rows in another order (shuffled or "
                           "re-exported without a fixed order); the saved secret partition is by row position, so "
                           "examples would participate closer together than the accounting allows. Resume with the "
                           f"rows in their original order, or {fix}")
    raise RowsMismatch(f"{where}: the training rows differ from those the saved state was written for ({now['n']} "
                       f"rows now, {saved['n']} then, other content); resume with the same rows, or {fix}")
