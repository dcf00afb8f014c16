"""`python -m gpuopt.env`: the devices, fingerprint, matmul peak and poor choices of this machine.

`--json` is for the sweeper: it runs this in a subprocess (so that its own process never imports
torch) and judges its preset's choices by these facts with the knob catalogue's rules
(gpuopt.core.knobs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuopt.core.knobs import poor_rows
from gpuopt.trial.devices import (
    detect_capabilities,
    fingerprint,
    list_devices,
    resolve_device,
    supported_modes,
    why_no_accelerator,
)
from gpuopt.trial.matmul_peak import cache_dir, probed_peak_flops


def _print_human(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table("device", "name", "details", title="Devices gpuopt sees")
    for d in data["devices"]:
        details = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("device", "name"))
        table.add_row(d["device"], d["name"], details)
    console.print(table)
    fp = Table(title="Environment fingerprint", show_header=False)
    for key, value in data["fingerprint"].items():
        fp.add_row(key, str(value))
    console.print(fp)
    console.print(f"[bold]Default device:[/bold] {data['device']} ({data['device_name']})")
    if data.get("peak_flops"):
        peaks = ", ".join(
            f"{mode} {flops / 1e12:.3g} TFLOP/s" for mode, flops in data["peak_flops"].items()
        )
        console.print(f"[bold]Measured matmul peak:[/bold] {peaks} (cached in {cache_dir()})")
    if "gpm" in data:  # CUDA: SM activity beside util.gpu (the default utilization objective)
        gpm = "yes: sm_active is the utilization objective" if data["gpm"] else data.get("gpm_why")
        console.print(f"[bold]GPM (SM, tensor-core, DRAM activity):[/bold] {gpm}")
    if data.get("accelerator"):
        console.print(f"[yellow]No accelerator visible:[/yellow] {data['accelerator']['why']}")
        console.print(f"  What to do: {data['accelerator']['what_to_do']}")
    if data["poor_choices"]:
        title = f"Poor choices on {data['device']} (dropped from preset search spaces)"
        poor = Table("key", "values", "why", title=title)  # one row per rule (gpuopt.core.knobs)
        for row in data["poor_choices"]:
            poor.add_row(row["key"], row["values"], row["why"])
        console.print(poor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuopt.env", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument(
        "--no-probe", action="store_true", help="skip the measured matmul peak (cached per machine)"
    )
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    data = detect_capabilities(device)
    data["fingerprint"] = fingerprint(device)
    if not args.no_probe:
        data["peak_flops"] = {
            mode: probed_peak_flops(device, mode, data["fingerprint"])
            for mode in supported_modes(device)
        }
    data["devices"] = list_devices()
    data["accelerator"] = why_no_accelerator()
    data["poor_choices"] = poor_rows(data)  # one row per rule that applies here
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_human(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
