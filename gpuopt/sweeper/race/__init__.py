"""The race: a sweep's trials in one shared process where the space allows (runner.py)."""
