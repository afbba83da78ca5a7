"""The ``kvrouter`` console script.  Each subcommand lives in its own module, imported only when it runs:
``kvrouter serve`` never loads the lab (simulator, evaluator, benchmarks, reliability suite).

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.  The router's own commands
are listed here; other distributions (the lab, ``kvrouter.lab``) add theirs through the
``kvrouter.commands`` entry-point group, each entry naming a table ``{name: (module, help)}``.  The router
never names a lab module: the dependency points from the lab to the router only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import entry_points

CommandTable = dict[str, tuple[str, str]]

COMMANDS: CommandTable = {
    "indexer": ("kvrouter.commands.indexer", "run the KV-cache indexer service for a fleet"),
    "serve": ("kvrouter.commands.serve", "run the OpenAI-compatible KV-aware gateway"),
    "epp": ("kvrouter.commands.epp", "run as the Endpoint Picker of an inference gateway (Envoy ext_proc)"),
    "check": ("kvrouter.commands.check", "verify a fleet file and every instance before traffic"),
}

ENTRY_POINT_GROUP = "kvrouter.commands"


def plugin_commands() -> CommandTable:
    """The commands other installed distributions register (the lab's: sim, demo, eval, bench, ...)."""
    out: CommandTable = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        table = ep.load()
        out.update({k: v for k, v in table.items() if k not in COMMANDS})
    return out


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option or its value)."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--log-level":
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the module of the command ``argv`` names is imported (all of them when
    ``argv`` is None, e.g. to check every command's arguments).  Registered tables are read only when
    the command is not the router's own."""
    ap = argparse.ArgumentParser(prog="kvrouter", description="KV-cache-aware routing for vLLM fleets")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    wanted = None if argv is None else _command_of(argv)
    commands = COMMANDS if wanted in COMMANDS else {**COMMANDS, **plugin_commands()}
    for name, (module, helptext) in commands.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        if argv is not None and name != wanted:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return ap


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process's own command line: only then may it be re-executed
        from .allocator import AllocatorError, prefer_jemalloc

        try:
            prefer_jemalloc(_command_of(sys.argv[1:]))
        except AllocatorError as e:
            print(f"kvrouter: {e}", file=sys.stderr)
            return 2
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser(argv)
    args = ap.parse_args(argv)
    from .logs import setup_logging

    setup_logging(args.log_level)
    if not args.command:
        ap.print_help()
        return 2
    if getattr(args, "_missing", None):
        logging.getLogger("kvrouter").error("command %r is not available in this build", args.command)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
