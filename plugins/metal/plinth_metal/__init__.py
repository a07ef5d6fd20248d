"""plinth's Apple Silicon backend: torch MPS kernels designed around MPS's known defects.

Importing this package touches no device: the probe asks torch whether MPS is built and available,
so a Linux machine loads the plugin and lists ``metal`` with score 0 and why.
"""
