"""Policy workers: the model, the loss, data-parallel training on Ray, checkpoints."""
