"""``python -m miles_verifiers [--with PACKAGE ...]``: build the verifiers venv (see :mod:`miles_verifiers.venv`)."""

from miles_verifiers.venv import main

main()
