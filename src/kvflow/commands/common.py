"""What every command shares: kvflow's exceptions turned into messages and exit codes (never a
traceback on the terminal; an unexpected one saved to a file), the plugin registry under
`--strict-plugins`, the console, and the help texts of options that several commands take."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import click
import typer

from kvflow.errors import EXIT_INTERRUPTED, EXIT_PLUGIN_ERROR, EXIT_USER_ERROR, KvflowError, PluginError, UserError
from kvflow.faults import crash_report

state = {"strict": False}


def err(text: str) -> None:
    # plain stderr (not rich): messages contain brackets like `pruners[0]` that rich would eat
    print(text, file=sys.stderr, flush=True)


@contextmanager
def errors(interrupted: str = "kvflow: interrupted") -> Iterator[None]:
    """Turn kvflow's exceptions into messages and exit codes, never tracebacks."""
    try:
        yield
    except UserError as e:
        err(e.format())
        raise typer.Exit(EXIT_USER_ERROR) from None
    except PluginError as e:
        err(f"kvflow: plugin error: {e}")
        raise typer.Exit(EXIT_PLUGIN_ERROR) from None
    except KvflowError as e:  # e.g. an engine worker that died: its own words, no traceback
        err(f"kvflow: {e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err(interrupted)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort, SystemExit, click.ClickException):
        raise
    except Exception as e:  # a plugin's fault (exit 5), else a bug of kvflow's (exit 1); the traceback on disk
        lines, code = crash_report(e, save_traceback(e))
        for line in lines:
            err(line)
        raise typer.Exit(code) from None


def save_traceback(exc: BaseException) -> Optional[Path]:
    """Write the exception's traceback under the kvflow cache (or the temp dir); its path."""
    import tempfile
    import time as _time
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"kvflow-traceback-{_time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (os.environ.get("KVFLOW_CACHE"), os.path.join(os.path.expanduser("~"), ".cache", "kvflow"),
                   tempfile.gettempdir()):
        if not folder:
            continue
        try:
            path = Path(folder) / "tracebacks" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(" ".join(sys.argv) + "\n\n" + text, encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def plugin_registry():
    from kvflow.registry import get_registry

    return get_registry(strict=state["strict"])


def rich_console():
    from rich.console import Console

    return Console(highlight=False)


SET_HELP = "Override a value: PATH=VALUE, VALUE in YAML (e.g. proposers.base.evictor.budget=128, proposers.base.pruners=[])."
UNSET_HELP = "Remove a key, e.g. proposers.helper (applied before --set)."
