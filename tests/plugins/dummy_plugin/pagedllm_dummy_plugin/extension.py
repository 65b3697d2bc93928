"""A step extension: every request stops after its first ``MAX_OUTPUT`` tokens.

Turned on by ``--step-extensions dummy_cap``; it keeps its state (the cap) in
``request.features["dummy_cap"]`` and looks at the new tokens of those requests only.
"""

# [docs:extension]
from pagedllm.core.interfaces import StepExtension
from pagedllm.core.request import RequestStatus

MAX_OUTPUT = 2


class CapExtension(StepExtension):
    name = "dummy_cap"

    @classmethod
    def from_engine(cls, engine):
        return cls()  # (named by --step-extensions: always on then)

    def new_request(self, request):
        request.features[self.name] = MAX_OUTPUT

    def check_token(self, request, token):
        if request.num_output_tokens >= request.features[self.name]:
            request.stop_reason = self.name
            return RequestStatus.FINISHED_STOPPED
        return None


# [/docs:extension]
