"""The `bloompeer` command: one subcommand per module (dht, serve, generate, status, api).

Each command module has `add_parser(commands)` and `run(args) -> exit code`; this module only
assembles them, configures logging, and turns whatever a command raises into one line on stderr
and an exit code (the traceback only with --verbose). Results go to stdout (multiaddrs, the
"online" line, generated text); logs go to stderr. Commands never import this module.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time

from ... import _version
from ...errors import BloompeerError
from . import dht_command, generate_command, serve_command, status_command
from . import api_command
from .flags import check_arguments
from .import_gc import imports_without_gc
from .local_swarm import EXIT_WITH_PARENT_ENV

__all__ = ["main", "build_parser"]

logger = logging.getLogger("bloompeer")

COMMANDS = {"dht": dht_command, "serve": serve_command, "generate": generate_command, "status": status_command,
            "api": api_command}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloompeer", description="Run language models (BLOOM, Llama, Mistral, Qwen2, Qwen3) collaboratively: "
                                      "volunteers serve transformer blocks, users generate text through the swarm.")
    parser.add_argument("--version", action="version", version=f"bloompeer {_version.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log debug details (and hivemind's INFO), and tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    _exit_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    _configure_logging(args.verbose)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place every error becomes a line and an exit code
        _report(exc, args.verbose)
        return 1
    finally:
        # At exit the interpreter would walk and finalize every object that torch and transformers
        # made (a second or more on 2 cores, for memory the OS takes back anyway); frozen ones it
        # leaves alone. The command has released its threads, daemon and files by now.
        gc.freeze()


def _report(exc: Exception, verbose: bool) -> None:
    """Our errors (and the OS's, and bad values) say what to do in their message; anything else is a bug."""
    if isinstance(exc, (BloompeerError, ValueError, OSError)):
        logger.error("%s", exc, exc_info=verbose)
    else:
        logger.error("unexpected %s: %s (a bug in bloompeer: run again with --verbose for the traceback, and "
                     "report it)", type(exc).__name__, exc, exc_info=verbose)


def _configure_logging(verbose: bool) -> None:
    with imports_without_gc():  # hivemind imports torch
        from ...p2p.hivemind_package import install as install_hivemind_package

        install_hivemind_package()  # hivemind then loads without its package init (bloompeer.p2p did it already)
        from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.WARNING)


def _exit_with_parent() -> None:
    """For children of a LocalSwarm: SIGTERM ourselves when the parent process is gone, however it
    died. (Polled: Linux's PR_SET_PDEATHSIG fires when the parent *thread* ends, which is wrong for
    a parent that starts peers from a worker thread.)"""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="bloompeer-parent-watch", daemon=True).start()
