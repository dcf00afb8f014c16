"""Switch hydra-optuna-sweeper configs to gpuopt's sweeper: `python -m gpuopt.migrate PATH...`.

Changing `override hydra/sweeper: optuna` to `gpuopt` is enough for Hydra's own examples, but a
config that also names the stock class (lightning-hydra-template's
`configs/hparams_search/mnist_optuna.yaml`: `hydra.sweeper._target_: ...OptunaSweeper`) would then
instantiate the stock class with gpuopt's keys (`TypeError: ... unexpected keyword argument
'objectives'`). This rewrites both lines in place and nothing else (a line edit, not a YAML round
trip, so comments and order stay), and prints the diff. PATH is a YAML file or a folder (every
*.yaml under it); `--check` changes nothing and exits 1 when a file would change (for CI).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

STOCK_TARGET = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
GPUOPT_TARGET = "gpuopt.sweeper.plugin.GpuoptSweeper"

# `- override hydra/sweeper: optuna` and `- override /hydra/sweeper: optuna` (quotes, comments kept)
_DEFAULTS_LINE = re.compile(
    r"""^(?P<head>\s*-\s*override\s+/?hydra/sweeper\s*:\s*)(?P<q>["']?)optuna(?P=q)(?P<tail>\s*(\#.*)?)$"""
)
_TARGET_LINE = re.compile(
    r"""^(?P<head>\s*_target_\s*:\s*)(?P<q>["']?)"""
    + re.escape(STOCK_TARGET)
    + r"""(?P=q)(?P<tail>\s*(\#.*)?)$"""
)


def migrate_text(text: str) -> str:
    """The text with the sweeper selection and the stock `_target_` switched to gpuopt's."""
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        ending = line[len(body) :]
        for pattern, value in ((_DEFAULTS_LINE, "gpuopt"), (_TARGET_LINE, GPUOPT_TARGET)):
            if match := pattern.match(body):
                body = f"{match['head']}{match['q']}{value}{match['q']}{match['tail']}"
        out.append(body + ending)
    return "".join(out)


def _read(paths: Sequence[Path]) -> dict[Path, str]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*.yaml") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(path)
    return {file: file.read_text() for file in files}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuopt.migrate",
        description="Switch hydra-optuna-sweeper configs to gpuopt's sweeper (in place).",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="YAML files or config folders")
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a file would change"
    )
    args = parser.parse_args(argv)
    try:
        texts = _read(args.paths)
    except (FileNotFoundError, OSError, UnicodeDecodeError) as exc:
        print(f"gpuopt.migrate: cannot read {exc}", file=sys.stderr)
        return 2
    changes = {path: (old, new) for path, old in texts.items() if (new := migrate_text(old)) != old}
    if not changes:
        print("gpuopt.migrate: nothing to migrate (no hydra-optuna-sweeper selection found)")
        return 0
    for path, (before, after) in changes.items():
        sys.stdout.writelines(
            difflib.unified_diff(
                before.splitlines(keepends=True),
                after.splitlines(keepends=True),
                fromfile=f"{path} (hydra-optuna-sweeper)",
                tofile=f"{path} (gpuopt)",
            )
        )
        if not args.check:
            path.write_text(after)
    verb = "would change" if args.check else "changed"
    print(f"gpuopt.migrate: {verb} {len(changes)} file(s)")
    return 1 if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
