"""The runtime: the engine, the model runner, decode step graphs, the sampler and the outputs.

Everything here runs after a backend is selected: it holds torch tensors and calls the backend's
kernels, never a hook. The scheduling layer it drives (:mod:`plinth.sched`) stays torch-free.
"""
