"""The verifiers side of miles-verifiers (runs in the verifiers venv, imports no Miles code)."""
