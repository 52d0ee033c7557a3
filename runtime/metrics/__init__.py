"""A step's metrics (what a step reports, what a checkpoint can be ranked by) and their log."""
