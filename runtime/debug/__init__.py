"""Replay-based debugging: what a step trained on, and whether the current code repeats it.

`start` finds where a re-run begins (the newest checkpoint before step N that the log and
the disk both vouch for); `samples` rebuilds the loaders there and reads forward to step N,
proving each batch against the log's sample digests; `reproduce` re-executes the steps in a
scratch run directory and compares them with the log bit for bit.
"""
