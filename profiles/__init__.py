"""Shipped profile files (*.toml); `--profile NAME.toml` looks here when no such path exists."""
