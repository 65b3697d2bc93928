"""An executor: the built-in single-process one, logging each step it runs (what a
plugin executor does is up to it: run the ranks elsewhere, trace them...)."""

import logging

from pagedllm.executors.uni import UniProcExecutor

logger = logging.getLogger("pagedllm_dummy_plugin")


# [docs:executor]
class CountingExecutor(UniProcExecutor):
    """``--distributed-executor-backend dummy_exec``: rank 0 in this process, as ``uni``."""

    def __init__(self, config, pm):
        super().__init__(config, pm)  # (starts nothing: one rank, here)
        self.steps = 0

    def execute(self, output, token_mask):
        self.steps += 1
        logger.info("dummy executor: step %d, %d requests", self.steps, len(output.scheduled))
        return super().execute(output, token_mask)


# [/docs:executor]
