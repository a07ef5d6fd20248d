"""Process start-up with Python's cyclic garbage collector paused.

A command that builds an engine first allocates millions of objects that live as long as the process:
importing torch ran the collector ~375 times here (0.25 s), building the default engine ~84 more times
(0.15-0.18 s), each scan finding nothing to free. The ``plinth`` commands that build an engine call
:func:`pause_collector` first and :func:`start_up_done` once the engine exists, which also freezes those
objects out of the collector's generations: later full collections (a server's, between requests) do not
scan them again either. :func:`resume_collector` undoes a pause whose start-up failed.
"""

from __future__ import annotations

import gc

_paused = False  # pause_collector turned the collector off, and nothing has turned it back on


def pause_collector() -> None:
    """Pause the cyclic GC for start-up (nothing to do when it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def start_up_done() -> None:
    """Start-up has built what the process keeps: freeze it and resume the GC, if it was paused here."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


def resume_collector() -> None:
    """Resume the GC without freezing anything (start-up failed), if it was paused here."""
    global _paused
    if _paused:
        gc.enable()
        _paused = False
