"""Prompts in, a train batch out: datasets, rewards, collection, a step's rollout (step.py), DAPO's
dynamic sampling, and the batch's preparation (log-probs, advantages: prepare.py)."""
