"""How the command line fails: one line, `error: ...`, naming the file or field, never a
traceback; exit 2 for input the user can fix (the command, the job, the run directory) and
1 for the machine (a full disk, a path it will not let us write, a missing package)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from draftgen.errors import DiskError, DraftgenError, HostError

_err = Console(stderr=True)

# Typer's parsing errors (a missing argument, `-n abc`), found by name: newer typers carry
# their own copy of click, so `click.ClickException` would not catch them.
_ClickError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def error_line(message: str) -> None:
    """The one line every failure prints: `error: ...`, never wrapped, never markup."""
    text = " ".join(message.split())
    _err.print(f"[bold red]error:[/] {escape(text)}", highlight=False, markup=True,
               soft_wrap=True)


def fail(e: DraftgenError) -> typer.Exit:
    error_line(str(e))
    # The input is fine but the machine is not (a full disk, a path it will not let us
    # write, a missing package): 1. Anything the user can fix in the command or job: 2.
    code = 1 if isinstance(e, DiskError | HostError) else 2
    return typer.Exit(code)


def _verb(ctx: Any) -> str:
    """`draftgen engine build-model`, whatever the program was called (`python -m draftgen`)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["draftgen", *reversed(names)])


class OneLineErrors(TyperGroup):
    """Usage errors in one `error:` line, like draftgen's own; and a last resort for an OS
    error no command expected (one line, exit 1) instead of a traceback."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode,
                                windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args,
                                **extra)
        except _ClickError as e:
            if type(e).__name__ != "NoArgsIsHelpError":  # that one has printed the help
                error_line(f"{getattr(e, 'format_message', e.__str__)()}"
                           f" (see {_verb(getattr(e, 'ctx', None))} --help)")
            sys.exit(getattr(e, "exit_code", 2))
        except typer.Abort:
            error_line("aborted")
            sys.exit(1)
        except OSError as e:
            name = f"{e.filename}: " if e.filename else ""
            error_line(f"{name}{e.strerror or e}")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
