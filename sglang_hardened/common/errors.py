"""The one exception type the CLI turns into a clear message and a non-zero exit."""


class HardenedError(Exception):
    """A failure caused by input the user can fix: the message names the cause."""
