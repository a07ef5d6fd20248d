"""plinth's Intel Gaudi backend: flat paged attention and bucketed, never-mixed HPU-graph steps.

Importing this package touches no device and never imports ``habana_frameworks``.
"""
