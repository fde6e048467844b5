"""
The exception types that the command line turns into a clean one-line error.

Where stock SB3 (or Python) raises ``ValueError`` or ``TypeError`` for the same bad argument, we raise the typed
subclass, so that code written against stock SB3 catches ours too.
"""


class UserError(Exception):
    """
    Bad input from the user (unknown env id, malformed YAML, bad hyperparameter, ...).

    The message is one line that names the problem and the fix; the CLI prints it on stderr
    and exits with code 2, without a traceback.
    """

    exit_code = 2


class UserValueError(UserError, ValueError):
    """A bad argument value, where stock SB3 or Python would raise ``ValueError``."""


class UserTypeError(UserError, TypeError):
    """An argument of the wrong kind (or one that the chosen class does not take), where stock raises ``TypeError``."""


class MissingExtraError(UserError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install 'sb3-speedups[extra]'`` to run."""
