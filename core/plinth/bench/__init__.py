"""Benchmarks (``plinth bench ...``), one module each: ``serve`` load-tests a running server,
``throughput``, ``latency``, ``prefill`` and ``speculative`` measure the offline engine; ``roofline``
holds the limits they are set against (read bandwidth, the model's weight stream, GEMM peak)."""


class BenchError(Exception):
    """A benchmark that cannot run as asked (an unreachable server, an unusable dataset, a failed
    child run); ``plinth`` prints the message, no traceback."""


def output_path(text: str) -> str:
    """An argparse type for ``--json FILE``: refused at once if it cannot be written (a missing folder,
    a directory), not after the benchmark has run."""
    import argparse
    import os

    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory {folder!r}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write in {folder!r}")
    return text
