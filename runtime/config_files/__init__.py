"""Config files read as NeMo RL reads them: OmegaConf with a `defaults:` chain, `_override_`,
interpolations with NeMo RL's resolvers, Hydra-style overrides, and no duplicate keys."""
