"""The Lightning engine (`engine.name=lightning`) and the public `gpuopt.MeasureCallback`."""
