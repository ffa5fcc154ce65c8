"""Holding a notebook's interrupt (SIGINT) while a call is handed to the ranks.

A call submitted to some ranks but not to others would leave the others waiting in a collective
for ever. The submission takes milliseconds, so an interrupt that arrives during it is held and
raised right after, when every rank has the call; waiting for results stays interruptible.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Delay SIGINT until the block has finished (only the main thread receives signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # delivered to the handler the kernel had installed
