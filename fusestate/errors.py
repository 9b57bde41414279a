"""Errors that reach the user as one clear line instead of a traceback."""


class UserError(Exception):
    """A problem the user can fix (bad URL, missing bucket, busy mountpoint...).

    The CLI prints ``fusestate: <message>`` and exits with ``exit_code``.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class FsError(OSError):
    """A POSIX error for the caller (FUSE or a test): raised by the metadata engines and the vfs."""

    def __init__(self, code: int, detail: str = "") -> None:
        import os

        super().__init__(code, detail or os.strerror(code))
