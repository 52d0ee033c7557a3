"""Resuming never silently changes the computation: which config keys decide a step, what
the inputs behind the config's paths are, and what changed since a checkpoint."""
