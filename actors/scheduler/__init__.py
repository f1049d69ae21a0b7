"""The scheduler actor (docs/architecture.md, "Scheduler"): `Scheduler` (scheduler.py) drives
steps; `Planner` (planner.py) holds every live request (`Req`, request.py) and decides as plain
Python, with prefix sharing (prefix_sharing.py), window trims (window_trims.py) and
disaggregation's half of a request (planner_transfers.py)."""
