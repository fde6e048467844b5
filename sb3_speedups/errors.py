"""The one exception type that the command line turns into a clean one-line error."""


class UserError(Exception):
    """
    Bad input from the user (unknown env id, malformed YAML, bad hyperparameter, ...).

    The message is one line that names the problem and the fix; the CLI prints it on stderr
    and exits with code 2, without a traceback.
    """

    exit_code = 2
