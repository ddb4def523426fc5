"""CLI commands, one module per concern; each defines register(app: typer.Typer)."""
