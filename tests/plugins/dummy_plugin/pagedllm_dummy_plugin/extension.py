"""A step extension: every request stops after its first ``MAX_OUTPUT`` tokens, and the
extension counts the tokens the model computed (its ``computed_tokens`` counter).

Turned on by ``--step-extensions dummy_cap``; it keeps its state (the cap) in
``request.features["dummy_cap"]`` and looks at the new tokens of those requests only. Its
runner side, built on every rank, reads each step's hidden states on rank 0.
"""

# [docs:extension]
from pagedllm.core.interfaces import RunnerExtension, StepExtension
from pagedllm.core.request import RequestStatus

MAX_OUTPUT = 2


class CapExtension(StepExtension):
    name = "dummy_cap"

    def __init__(self):
        super().__init__()
        self.stats = {"computed_tokens": 0}

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

    # The runner side: what every rank gets (picklable; None: no runner side), and what
    # each rank's worker builds from it.
    def runner_payload(self):
        return {}

    @classmethod
    def make_runner_extension(cls, payload, worker):
        return TokenCounter()

    def read_outputs(self, output, result):
        counted = result.extras.get(self.name)
        if counted is not None:
            self.stats["computed_tokens"] += counted
        return {}  # (the requests take their sampled tokens as usual)


class TokenCounter(RunnerExtension):
    name = "dummy_cap"

    def finish(self, claims, hidden, logits_of, result):
        # Rank 0, every step: one row of hidden states per token the model computed.
        result.extras[self.name] = hidden.shape[0]


# [/docs:extension]
