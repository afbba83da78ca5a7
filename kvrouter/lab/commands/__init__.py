"""The lab's commands, registered with the ``kvrouter`` CLI through the ``kvrouter.commands`` entry point
(``pyproject.toml``): this table is all the CLI loads until one of them is named."""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("kvrouter.lab.commands.sim", "start a simulated vLLM fleet on 127.0.0.1"),
    "demo": ("kvrouter.lab.commands.demo", "simulated fleet + gateway + workload, every policy, one table"),
    "eval": ("kvrouter.lab.commands.eval", "trace-driven evaluation of routing policies in virtual time"),
    "bench": ("kvrouter.lab.commands.bench", "benchmarks (JSON out)"),
    "agreement": (
        "kvrouter.lab.commands.agreement",
        "the live path (demo) against the simulation (eval) on one workload",
    ),
    "reliability": (
        "kvrouter.lab.commands.reliability",
        "fault, fuzz and load suite with a table of figures",
    ),
}
