"""The driver side of a run: config to Ray cluster, workers, resume point; the driver loop;
whether the driver is still alive."""
