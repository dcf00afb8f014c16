"""A task function defined in the app's main script, found again by name in the trial process.

cloudpickle pickles whatever lives in `__main__` by value: the task and, through its globals, the
script's classes. Those often do not survive it (a Dataset method saying `self.classes` takes
`torch.classes` along: `TypeError: cannot pickle '_Classes' object`; `torch.backends.cudnn` fails
the same way), and a class pickled by value is a copy, not the script's class. `MainTask`, pickled
by reference, records where the task lives and, in the trial, imports the script as
multiprocessing's spawn re-imports `__main__`: as `__mp_main__` (its `if __name__ == "__main__":`
block does not run), with the sweeping process's `sys.path`.

Hydra imports the launchers on every run (plugin discovery): standard library only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# multiprocessing's name for a re-imported main script (multiprocessing.spawn._fixup_main_from_path)
MAIN_ALIAS = "__mp_main__"


@dataclass(frozen=True)
class MainTask:
    """The task `qualname` of the main script at `path`, or of the module `module` (`-m`)."""

    qualname: str
    path: str | None = None  # python train.py: the script's absolute path
    module: str | None = None  # python -m pkg.train: the module's name
    sys_path: tuple[str, ...] = ()  # the sweeping process's sys.path, as spawn passes it on

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled before the rest of the launcher: the paths first, so that whatever follows
        # (and the script) imports as it did in the sweeping process.
        self.__dict__.update(state)
        sys.path[:0] = [p for p in self.sys_path if p not in sys.path]

    def __call__(self, cfg: Any) -> Any:
        # Hydra's decorated main calls the undecorated task when given a config (cfg_passthrough).
        return functools.reduce(getattr, self.qualname.split("."), self.load_module())(cfg)

    def load_module(self) -> ModuleType:
        if self.module is not None:
            return importlib.import_module(self.module)
        assert self.path is not None
        loaded = sys.modules.get(MAIN_ALIAS)
        if loaded is not None and getattr(loaded, "__file__", None) == self.path:
            return loaded
        spec = importlib.util.spec_from_file_location(MAIN_ALIAS, self.path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the main script {self.path} of the swept app")
        module = importlib.util.module_from_spec(spec)
        sys.modules[MAIN_ALIAS] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[MAIN_ALIAS]
            raise
        # As under `python train.py`: `__main__` is the script, without a spec, so spawn's
        # DataLoader workers and Lightning's re-launched ranks import it again by its path.
        module.__spec__ = None
        sys.modules["__main__"] = module
        return module


def for_main(task_function: Any) -> Any:
    """`task_function` as the launcher should pickle it: a `MainTask` when it is found by name at
    the top level of the main script, else itself (an importable module's: cloudpickle pickles it
    by reference)."""
    qualname = getattr(task_function, "__qualname__", "")
    main = sys.modules.get("__main__")
    if getattr(task_function, "__module__", None) != "__main__" or main is None:
        return task_function
    try:  # the name may be Hydra's decorated main
        target = functools.reduce(getattr, qualname.split("."), main) if qualname else None
    except AttributeError:
        return task_function
    module, path = origin(main)
    if target is not task_function and inspect.unwrap(target) is not task_function:
        return task_function  # not found by name (a local function, ...)
    if module is None and path is None:
        return task_function  # python -c, an interactive session: nothing to import again
    sys_path = tuple(os.path.abspath(p) for p in sys.path)  # '' (python -c, -m): this cwd
    return MainTask(qualname, path=path, module=module, sys_path=sys_path)


def origin(main: ModuleType | None) -> tuple[str | None, str | None]:
    """(module, absolute script path) of the main program: `python -m pkg.train` or `train.py`."""
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name, None
    path = getattr(main, "__file__", None)
    return None, os.path.abspath(path) if path else None
