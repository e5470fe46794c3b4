"""`python -m pipeline` is the `gpufeed` command."""

from .cli import main

main()
