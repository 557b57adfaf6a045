"""``tspd keys generate DIR``: key material for tspd's secure mode (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

import click

from tspd.core.errors import TspdError

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """Key material for secure mode: CURVE key pairs, a TLS CA and certificate, a token."""


@keys.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--name",
    "names",
    multiple=True,
    default=("prefill", "decode"),
    show_default=True,
    help="A process to make a CURVE key pair for (repeat the option).",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=("127.0.0.1", "localhost"),
    show_default=True,
    help="A name or address the bootstrap server's certificate is valid for (repeat).",
)
@click.option("--days", default=365, show_default=True, help="Days the certificates are valid.")
@click.option("--no-tls", is_flag=True, help="No TLS CA and certificate.")
@click.option("--no-token", is_flag=True, help="No bootstrap bearer token.")
@click.option("--force", is_flag=True, help="Overwrite key pairs that exist already.")
def generate(
    directory: Path,
    names: tuple[str, ...],
    hosts: tuple[str, ...],
    days: int,
    no_tls: bool,
    no_token: bool,
    force: bool,
) -> None:
    """Write a CURVE key pair per --name, an allow-list of them all, a self-signed TLS
    CA with a bootstrap server certificate for every --host, and a bearer token into
    DIRECTORY; print the variables each process needs."""
    from tspd.keys import generate_keys

    existing = [n for n in names if (directory / "curve" / f"{n}.key_secret").exists()]
    if existing and not force:
        raise click.ClickException(
            f"key pairs for {', '.join(existing)} exist in {directory}/curve; pass --force "
            "to replace them (every peer's allow-list must then be updated)"
        )
    try:
        files = generate_keys(
            directory, list(names), hosts=hosts, tls=not no_tls, token=not no_token, days=days
        )
    except TspdError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote secure-mode material to {directory}:")
    for name, (public, secret) in files.curve.items():
        click.echo(f"  {name}: {public} (public, key {files.public_key(name)}), {secret}")
    click.echo(f"  allow-list: {files.allow_dir}")
    if files.ca_file is not None:
        click.echo(f"  TLS: CA {files.ca_file}, server {files.cert_file} + {files.key_file}")
    if files.token_file is not None:
        click.echo(f"  bearer token: {files.token_file}")
    click.echo("\nenvironment of each process (docs/configuration.md):")
    for name in files.curve:
        env = " ".join(f"{k}={v}" for k, v in files.env(name).items())
        click.echo(f"  {name}: {env}")
    server = " ".join(f"{k}={v}" for k, v in files.env(server=True).items())
    click.echo(f"  bootstrap server: {server}")
    click.echo(
        "\nCopy each secret certificate to its process only; the allow-list, the CA and "
        "the token go to every process of the deployment."
    )
