"""The error users see when a model cannot be found or read."""


class ModelSourceError(Exception):
    """A model could not be found or read because of something the user can fix.

    The message says what went wrong and what to do; callers print it without a traceback."""
