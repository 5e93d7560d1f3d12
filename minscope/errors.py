"""Errors that stop a run for a reason the user has to look at. train.py prints their
message without a traceback; the run's last good state is on disk, so once the cause is
fixed `--resume` continues from there."""


class RunStopped(RuntimeError):
    """Training cannot go on: a non-finite reward, or several non-finite updates in a row."""
