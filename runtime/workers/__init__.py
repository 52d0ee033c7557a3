"""The policy workers on Ray: the typed calls the controller makes, what they answer, the
group that fans them out, the actor itself, the loader it owns and the files it writes.

The training itself (the replica, the model, FSDP, the loss) is plain torch in
`runtime.policy`, which never imports this package.
"""
