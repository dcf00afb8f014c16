"""Training engines, found by name (`engine.name`) in `gpuopt.engines.registry`.

- `native` (gpuopt.engines.native): gpuopt's own training loop.
- `lightning` (gpuopt.engines.lightning.engine): the trial runs through `lightning.Trainer`.
- `user_step` (gpuopt.engines.user_step): the user's own step (`gpuopt.measure_step`).

Engines never import each other; what they share lives in this package's private modules. Importing
this package imports neither torch nor any engine.
"""
