"""Export: a checkpoint of a Hugging Face run as a standalone model folder."""
