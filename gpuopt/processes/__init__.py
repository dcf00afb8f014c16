"""Processes the sweeper starts that drive the engines: the shared measuring process of the race
and the confirmation (`shared_windows`), and the memory probe (`memory_probe`). Torch side: they
build through `gpuopt.engines.registry`; `gpuopt.trial` is the layer under both."""
