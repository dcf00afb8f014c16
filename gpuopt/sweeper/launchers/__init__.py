"""Hydra launchers that run each trial in a fresh process (locally or under SLURM)."""
