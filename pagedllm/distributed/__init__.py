"""Running one model on several devices or processes (tensor parallelism) on
``torch.distributed``: :mod:`parallel_state` holds this process's place in the group and
the collectives the parallel layers call; :mod:`executor` starts and drives the worker
processes."""
