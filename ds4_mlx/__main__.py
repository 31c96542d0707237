"""``python -m ds4_mlx`` runs the command-line interface."""

from .cli import main

main()
