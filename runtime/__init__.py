"""The training runtime: launch, controller, checkpoint, policy, data and cli, one folder each."""
