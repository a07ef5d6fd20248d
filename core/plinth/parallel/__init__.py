"""Scale-out: tensor parallelism over ``torch.distributed`` (plugin API 1.7).

- :mod:`plinth.parallel.comm`: the default :class:`~plinth.platform.backend.Communicator`
  (``torch.distributed`` collectives) and the CPU control group rank 0 broadcasts each step over;
- :mod:`plinth.parallel.sharding`: the sharding plan the core owns (which slice of each weight a
  rank loads, while loading);
- :mod:`plinth.parallel.executor`: worker processes started and supervised by rank 0, and the
  worker's loop.
"""
