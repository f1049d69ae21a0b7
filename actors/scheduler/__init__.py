"""The scheduler actor (docs/architecture.md, "Scheduler"): `Scheduler` (scheduler.py) drives
steps; `Planner` (planner.py) plans them as plain Python over every live request (`Req`,
request.py) in its `RequestTable` (request_table.py, the phases) and the batches it launched
(`LaunchedBatches`, launched_batches.py), with prefix sharing (prefix_sharing.py), window
trims (window_trims.py) and disaggregation's half of a request (planner_transfers.py)."""
