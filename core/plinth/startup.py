"""Process start-up with Python's cyclic garbage collector paused.

A command that builds an engine first allocates millions of objects that live as long as the process:
importing torch ran the collector ~375 times here (0.25 s), building the default engine ~84 more times
(0.15-0.18 s), each scan finding nothing to free. The ``plinth`` commands that build an engine call
:func:`pause_collector` first and :func:`start_up_done` once the engine exists, which also freezes those
objects out of the collector's generations: later full collections (a server's, between requests) do not
scan them again either.
"""

from __future__ import annotations

import gc


def pause_collector() -> bool:
    """Pause the cyclic GC for start-up; True when this call paused it (it was running)."""
    if not gc.isenabled():
        return False
    gc.disable()
    return True


def start_up_done() -> None:
    """Start-up has built what the process keeps: freeze it and resume the GC, if it is paused."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
