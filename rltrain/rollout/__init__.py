"""Prompts in, scored samples out: datasets, rewards, and collection into train batches."""
