"""Error types shared by the runtime.

The CLI maps `UserInputError` (and its subclasses) to exit code 2, so anything raised
because a user's config, data set, arguments or files are wrong should derive from it
and name the key, file or line in its message.
"""


class UserInputError(Exception):
    """Bad input from the user: a config value, an argument, a file. CLI exit code 2."""
