"""A task function defined in the app's main script, found again by name in the trial process.

submitit pickles the launcher (and with it the task function) with cloudpickle, which pickles
whatever lives in `__main__` by value: the task, and through its globals the script's own
classes. Those often do not survive it: a Dataset method that says `self.classes` (torchvision's
name) makes cloudpickle take the module `torch.classes` along (`TypeError: cannot pickle '_Classes'
object`), one that says `torch.backends.cudnn` fails the same way; and a class pickled by value
is a copy, not the script's class. `MainTask` stands in for such a task: a small object of gpuopt's (pickled by
reference) that records where the task lives, the script's path (`python train.py`) or its module
name (`python -m pkg.train`) and the function's qualified name. Called in the trial process, it
imports the script the way multiprocessing's spawn start method re-imports `__main__`: as a module
named `__mp_main__` (so its `if __name__ == "__main__":` block does not run), with the sweeping
process's `sys.path` (the script's folder first, and whatever the script added, such as a project
root), then calls the task by name with the job's config. A task whose module is importable (an
installed package, `python -m pkg.mod` run as its module) is pickled by reference already, or
imported by its module name here.

Hydra imports the launchers on every run (plugin discovery): standard library only.
"""

from __future__ import annotations

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
        # Unpickled in the trial process before the rest of the launcher: the paths first, so
        # that whatever follows (and the script) imports as it did in the sweeping process.
        self.__dict__.update(state)
        extend_sys_path(self.sys_path)

    def __call__(self, cfg: Any) -> Any:
        # Hydra's decorated main calls the undecorated task when given a config
        # (hydra.main's cfg_passthrough); a plain task function takes the config itself.
        return self.resolve()(cfg)

    def resolve(self) -> Any:
        """The task, from the script imported in this process."""
        target: Any = self.load_module()
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target

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
        # As under `python train.py`: `__main__` is the script, without a spec, so DataLoader
        # workers started with spawn or forkserver import it again by its path (and find its
        # Dataset class under the same name), and a training that re-runs "the program" for its
        # other ranks (Lightning's DDP) runs it by path (gpuopt.sweeper.launchers.trial_task).
        module.__spec__ = None
        sys.modules["__main__"] = module
        return module


def extend_sys_path(paths: tuple[str, ...]) -> None:
    """Put the entries of `paths` this process lacks in front of its sys.path, in their order."""
    missing = [p for p in paths if p not in sys.path]
    sys.path[:0] = missing


def for_main(task_function: Any) -> Any:
    """`task_function` as the launcher should pickle it: a `MainTask` when it is defined at the
    top level of the main script (and can be found there by name), else itself."""
    if getattr(task_function, "__module__", None) != "__main__":
        return task_function  # an importable module: cloudpickle pickles it by reference
    qualname = getattr(task_function, "__qualname__", "")
    main = sys.modules.get("__main__")
    if not qualname or "<locals>" in qualname or main is None:
        return task_function
    if not _found(main, qualname, task_function):
        return task_function
    spec = getattr(main, "__spec__", None)
    sys_path = tuple(os.path.abspath(p) for p in sys.path)  # '' (python -c, -m): this cwd
    if spec is not None and spec.name and spec.name != "__main__":
        return MainTask(qualname, module=spec.name, sys_path=sys_path)
    path = getattr(main, "__file__", None)
    if not path:
        return task_function  # python -c, an interactive session: nothing to import again
    return MainTask(qualname, path=os.path.abspath(path), sys_path=sys_path)


def _found(main: ModuleType, qualname: str, task_function: Any) -> bool:
    """Whether `qualname` in the main script names this task (itself, or Hydra's decorated main)."""
    target: Any = main
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            return False
    return target is task_function or inspect.unwrap(target) is task_function
