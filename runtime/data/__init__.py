"""The energon data path: preparation, tokenizer, task encoder, packing, colocated loader."""
