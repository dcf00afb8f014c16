"""The Lightning engine (`engine.name=lightning`): the trial through `lightning.Trainer`, the
public `MeasureCallback`, and the profiled window for Lightning runs.
"""
