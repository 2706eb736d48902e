"""hpc-cli: a serving engine for hybrid-recurrent language models with a hybrid prefix cache."""

__version__ = "0.1.0"
