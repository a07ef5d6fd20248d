"""plinth's TPU backend: Pallas ragged paged attention, jnp GEMMs, torch <-> JAX crossing, AOT compiles.

Importing this package imports nothing from JAX: the kernel modules do, so the backend's probe can
run (and answer "no TPU") where JAX is absent or slow to start.
"""
