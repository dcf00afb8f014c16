"""Training engines, found by name (`engine.name`) in `gpuopt.engines.registry`: `native`
(gpuopt's own loop), `lightning` (`lightning.Trainer`), and `user_step` (`gpuopt.measure_step`).
Engines never import each other; what they share lives in this package's private modules.
Importing this package imports neither torch nor any engine.
"""
