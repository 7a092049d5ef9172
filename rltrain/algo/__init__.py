"""RL algorithms: advantage estimators and policy / KL / entropy losses, written next to their math."""
