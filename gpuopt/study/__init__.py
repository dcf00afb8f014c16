"""The stored study format, torch-free: what the sweeper writes into an Optuna study and the report
reads back. Both import it; it imports neither (only gpuopt.core)."""
