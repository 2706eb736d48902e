"""Built-in hpc-cli plugins, registered exactly as third-party plugins are."""
