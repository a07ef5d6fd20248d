"""The one device the core names: host memory.

torch calls host memory ``"cpu"``. The core reads checkpoints there, quantizes ggml blocks there and
runs its reference backend there, whichever backend serves the model; this is the only place it
spells that name (``tests/core/test_core_is_neutral.py`` holds it to that). Every other device the
core touches comes from a backend's :class:`~plinth.platform.backend.DeviceServices`.
"""

from __future__ import annotations

import torch

#: Host memory, where checkpoints are read and the reference backend computes.
HOST = torch.device("cpu")

#: torch.distributed's backend for host memory: the core's control group (each step's scheduler output
#: is broadcast over it) and the default device group of a backend that declares no communicator.
HOST_COLLECTIVES = "gloo"
#: The environment variable that binds :data:`HOST_COLLECTIVES` to one network interface (by name); unset,
#: it binds the address the host's name resolves to, which is the loopback on many machines.
HOST_COLLECTIVES_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
