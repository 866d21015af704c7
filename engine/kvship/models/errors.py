"""The error a model's configuration raises when kvship cannot run it (the API answers 400)."""


class UnsupportedModelError(ValueError):
    pass
