"""The errors fedcomp raises: one typed error per failure class."""


class FedcompError(Exception):
    """Base class of every error fedcomp raises on purpose."""


class SpecError(FedcompError, ValueError):
    """A codec spec string or codec parameter is invalid; the message lists what is allowed."""


class DecodeError(FedcompError):
    """A payload is malformed: truncated, corrupted, of another version, layout or codec.

    Decoding raises this error and nothing else for every malformed input.
    """
