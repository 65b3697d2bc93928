"""Running one model on several devices or processes on ``torch.distributed``:
:mod:`parallel_state` holds this process's place in the group and the collectives the
parallel layers call (the bottom layer; :mod:`pagedllm.executors` starts and drives the
ranks)."""
