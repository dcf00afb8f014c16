"""The gpuopt Hydra sweeper (Optuna), registered through the hydra.plugins entry point."""
