"""`ModelLoadError`: a model reference that cannot be turned into a model."""


class ModelLoadError(Exception):
    """The reference could not be turned into a model; the message says why, in user terms,
    and `help`, when given, how to fix it (else the caller's generic advice applies)."""

    def __init__(self, message: str, *, help: str | None = None) -> None:
        super().__init__(message)
        self.help = help
