"""``python -m sb3_speedups`` runs the command line."""

from sb3_speedups.cli import main_entry

main_entry()
