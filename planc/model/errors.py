"""`ModelLoadError`: a model reference that cannot be turned into a model."""


class ModelLoadError(Exception):
    """The reference could not be turned into a model; the message says why, in user terms."""
