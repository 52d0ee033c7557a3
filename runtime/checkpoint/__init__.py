"""Checkpoints: the directory store (write under a temporary name, fsync, rename, prune,
find), the save of one step, the files a policy worker writes, loader states, and the
checks a resume makes against the log."""
