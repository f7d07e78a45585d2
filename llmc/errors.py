"""One exception family for every user-facing failure.

Each error says what went wrong, why, and what to do. The CLI prints it as one line and exits non-zero;
only `--debug` shows the traceback.
"""


class LlmcError(Exception):
    """Base of every error a user can cause or fix."""

    def __init__(self, what: str, hint: str | None = None):
        self.what = what
        self.hint = hint
        super().__init__(what if hint is None else f"{what} ({hint})")


class CheckpointError(LlmcError):
    """A checkpoint directory is missing, incomplete, corrupt or inconsistent."""


class UnsupportedModelError(LlmcError):
    """The checkpoint asks for an architecture or feature llmc does not compile."""


class CompileError(LlmcError):
    """The compiler could not lower the model correctly."""


class ArtifactError(LlmcError):
    """A compiled artifact is missing, corrupt, or built for another target."""


class RequestError(LlmcError):
    """A generation request is malformed or cannot be served (prompt too long, bad parameters).

    param: the request field at fault ("temperature", "prompt", ...), or None; the server reports it in
    OpenAI's error body.
    """

    def __init__(self, what: str, hint: str | None = None, *, param: str | None = None):
        super().__init__(what, hint)
        self.param = param
