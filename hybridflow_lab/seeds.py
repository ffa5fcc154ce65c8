"""Seeds derived from a parent seed and a path of names and numbers, so that every random draw of a run has its own
stream: a step's generation, its n-th minibatch shuffle, a replica's sampling."""

from __future__ import annotations

import zlib

import numpy as np


def derive_seed(parent: int, *path: int | str) -> int:
    """A seed in [0, 2**63) that depends on ``parent`` and every element of ``path`` (names are hashed stably), with
    distinct paths giving independent streams (numpy's ``SeedSequence``)."""
    words = [parent, *(zlib.crc32(part.encode()) if isinstance(part, str) else part for part in path)]
    if any(word < 0 for word in words):
        raise ValueError(f"seeds are non-negative; got {parent} with path {path}")
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> np.uint64(1))
