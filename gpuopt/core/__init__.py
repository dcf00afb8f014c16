"""Torch-free foundations every process shares: typed specs and checks, errors, results, host facts,
limits, statistics, formatting, secrets, process lifelines and the one adapter of private
third-party internals. Imports no other gpuopt package.
"""
