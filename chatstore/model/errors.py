class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the path and the problem."""
