"""Process-level helpers every folder may use: fault points, niceness, the driver's liveness."""
