"""`python -m hpc_cli` runs the CLI."""

from hpc_cli.cli import main

if __name__ == "__main__":
    main()
