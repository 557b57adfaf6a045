"""``tspd diagrams``: render the state machines of :mod:`tspd.core.machines` as Mermaid.

Each :class:`~tspd.core.machines.MachineDeclaration` is handed, unchanged, to
``transitions``' ``GraphMachine`` with the Mermaid engine (no Graphviz needed), and
the ``stateDiagram-v2`` text is written to ``docs/state-machines/<name>.mmd``.
``--check`` writes nothing and fails when a committed diagram differs from its
declaration, so a stale diagram is caught by the test suite
(``tests/core/test_machines.py``).
"""

from __future__ import annotations

from pathlib import Path

import click

from tspd.core.machines import (
    DECODE_ROOM,
    PREFILL_ADDRESS_HEALTH,
    PREFILL_ROOM,
    MachineDeclaration,
)

__all__ = ["DECLARATIONS", "DEFAULT_DIR", "diagrams", "render", "stale"]

DECLARATIONS: tuple[MachineDeclaration, ...] = (PREFILL_ROOM, DECODE_ROOM, PREFILL_ADDRESS_HEALTH)
DEFAULT_DIR = Path("docs") / "state-machines"


class _Model:
    """The object ``GraphMachine`` decorates with the state and the graph."""


def render(declaration: MachineDeclaration) -> str:
    """The Mermaid ``stateDiagram-v2`` text of ``declaration``, titled with its name.

    The renderer styles the current state; every diagram is drawn in the initial
    state, so the text depends on the declaration alone.
    """
    from transitions.extensions import GraphMachine

    model = _Model()
    GraphMachine(
        model=model,
        graph_engine="mermaid",
        auto_transitions=False,
        title=declaration.name,
        **declaration.as_kwargs(),
    )
    text: str = model.get_graph().draw(None)  # type: ignore[attr-defined]
    return text.rstrip("\n") + "\n"


def _path(directory: Path, declaration: MachineDeclaration) -> Path:
    return directory / f"{declaration.name}.mmd"


def stale(directory: Path = DEFAULT_DIR) -> list[Path]:
    """The diagram files under ``directory`` that are missing or differ from their
    declaration."""
    out = []
    for declaration in DECLARATIONS:
        path = _path(directory, declaration)
        if not path.is_file() or path.read_text(encoding="utf-8") != render(declaration):
            out.append(path)
    return out


@click.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DIR,
    show_default=True,
    help="Where the .mmd files live.",
)
@click.option("--check", is_flag=True, help="Write nothing; fail if a diagram is stale.")
def diagrams(directory: Path, check: bool) -> None:
    """Render the room and heartbeat state machines as Mermaid diagrams."""
    if check:
        outdated = stale(directory)
        if outdated:
            names = ", ".join(str(p) for p in outdated)
            raise click.ClickException(
                f"state diagrams are stale: {names}; regenerate them with `tspd diagrams`"
            )
        click.echo(f"{len(DECLARATIONS)} state diagrams are up to date")
        return
    directory.mkdir(parents=True, exist_ok=True)
    for declaration in DECLARATIONS:
        path = _path(directory, declaration)
        path.write_text(render(declaration), encoding="utf-8")
        click.echo(f"wrote {path}")
