"""The one error type every command may raise for the user to read."""


class UserError(Exception):
    """A failure the user can act on; its message is printed as is."""
