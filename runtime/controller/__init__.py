"""The single controller: its run loop, the calls of one step (including what spans two
steps), the step's metrics and their log, and the fault points the reliability tests use."""
