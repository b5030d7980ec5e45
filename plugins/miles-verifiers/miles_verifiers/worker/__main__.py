"""Entry point of the verifiers worker: run as ``<verifiers venv>/bin/python <this folder> serve|describe``.

This folder is the worker's ``sys.path[0]``; what it imports is the ``miles_verifiers_worker`` package next to
this file, verifiers and the standard library. It never imports Miles: verifiers 0.4.0 needs openai < 3 and
Miles pins openai 3, so the two live in separate environments (see ``miles_verifiers.venv``).
"""

from miles_verifiers_worker.main import main

main()
