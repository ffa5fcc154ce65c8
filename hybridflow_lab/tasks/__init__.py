"""Tasks: prompts, ground truths and their reward rules."""
