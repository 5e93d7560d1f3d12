"""Environments: one module per benchmark (tasks, the two roles' prompts, turn order, reward)."""
