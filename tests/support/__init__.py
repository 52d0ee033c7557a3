"""What the tests share: small configs, log builders, synthetic sources, the reliability
harness, the trace scenarios and the fixtures."""
