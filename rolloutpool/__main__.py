"""``python -m rolloutpool``: the ``rolloutpool`` command."""

from rolloutpool.cli import main

main()
