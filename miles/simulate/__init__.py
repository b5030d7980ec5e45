"""Miles' control plane at scale, by simulation: its schedules, collector, stream, router and weight pushes,
unchanged, against simulated engines and trainers on a simulated clock (see :mod:`miles.simulate.cluster`)."""
