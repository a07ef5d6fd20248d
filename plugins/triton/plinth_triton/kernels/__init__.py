"""Triton kernels and their launchers. Every module here imports triton: import them lazily."""
