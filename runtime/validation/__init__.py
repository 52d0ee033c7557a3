"""Validation: the loss on held-out conversations, on the training workers, between steps."""
