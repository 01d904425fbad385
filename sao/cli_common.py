"""What every ``sao`` command shares: a usage error, and opening a lake from command-line options.

A leaf of the CLI: the command modules (``sao/runs_cli.py``, ``sao/lake/cli.py``, ``sao/train/cli.py``,
``sao/ui_cli.py``) import it, and ``sao/cli.py`` imports them; nothing here imports a command module.
"""

from __future__ import annotations

import typer

__all__ = ["HELP_MARKUP", "fail", "open_lake", "require_flows"]

# How every `sao` command's --help renders its texts (each `typer.Typer` of the CLI passes it). Markdown
# joins the docstrings' wrapped lines into paragraphs that fit the terminal, and keeps the `[train.steps]`
# that ends a flag's help; Typer's default, Rich markup, keeps the hard line breaks and takes such
# brackets for style tags, so the config key a flag sets went missing from `sao train --help`.
HELP_MARKUP = "markdown"


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr and return an Exit to raise (usage errors exit with 2)."""
    typer.echo(f"sao: error: {message}", err=True)
    return typer.Exit(code)


def require_flows(command: str) -> None:
    """A usage error when Prefect (the extra ``flows``, which ``command`` runs through) is not installed."""
    import importlib.util

    if importlib.util.find_spec("prefect") is None:
        raise fail(f"`{command}` runs through the Prefect flows, which need the extra `flows`: "
                   "pip install 'sao[flows]' (make demo and make test install it)")


def open_lake(root: str, storage_options: list[str] | None):  # -> Lake (imported lazily: a fast --help)
    """The existing lake at ``root`` with ``KEY=VALUE`` storage options; a usage error when it cannot
    be opened."""
    from sao.lake.config import LakeConfig
    from sao.lake.store import Lake, LakeError

    options: dict[str, str] = {}
    for item in storage_options or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--storage-option needs KEY=VALUE, got {item!r}")
        options[key] = value
    try:
        return Lake.open(LakeConfig(root=root, storage_options=options), create=False)
    except LakeError as error:
        raise fail(f"cannot open the lake at {root}: {error}") from None
