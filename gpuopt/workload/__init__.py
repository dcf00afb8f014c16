"""Workloads: built-in model families and synthetic datasets."""
