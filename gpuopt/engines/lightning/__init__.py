"""The Lightning engine (`engine.name=lightning`): the engine (engine), its meter of a fit (meter),
the precision mapping (precision), the distributed group's Lightning strategies (strategy), the
public `gpuopt.MeasureCallback` (callback), and the profiled window for Lightning runs (profile).
"""
