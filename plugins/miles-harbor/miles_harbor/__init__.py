"""Harbor task directories for Miles, both ways.

- Env ``harbor`` (:mod:`miles_harbor.env`): RL on Harbor tasks in the trajectory's Miles sandbox, without
  Docker and without the harbor package; data generator ``harbor_tasks``.
- :mod:`miles_harbor.harbor_environment`: a Harbor ``BaseEnvironment`` backed by a Miles sandbox, for
  Harbor's own trials (imported by Harbor, in Harbor's Python).

Importing this package imports neither Miles nor Harbor: each side imports only its own modules.
"""

__version__ = "0.1.0"
