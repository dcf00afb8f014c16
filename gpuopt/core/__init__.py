"""Torch-free foundations every process shares; imports no other gpuopt package."""
