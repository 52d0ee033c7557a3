"""Error types shared by the runtime.

The CLI maps `UserInputError` (and its subclasses) to exit code 2, so anything raised
because a user's config, data set, arguments or files are wrong should derive from it
and name the key, file or line in its message.
"""


class UserInputError(Exception):
    """Bad input from the user: a config value, an argument, a file. CLI exit code 2."""


class PeerStepError(RuntimeError):
    """This rank's step failed only because another data-parallel rank's did.

    Reports of a failed fan-out name the ranks whose own errors caused it first, and judge
    whether the failure was bad input by those alone.
    """
