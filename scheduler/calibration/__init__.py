"""Calibration: fitting the cost models' constants to measurements, in one place.

- `points`, `profile_fit`: `baton profile`'s grid points and the fit of a `WorkerProfile` to their times
  (non-negative relative least squares; the prefill floor).
- `windowed`: the scheduler's online refit of each worker's profile over a sliding window of samples.
- `serving`, `prefill_serving`: what a served step costs beyond the runner's (`ServingCost`, `baton plan
  --serving-*`), from token gaps and from replays of measured runs.
- `gateway`, `replay_score`: the gateway's event-loop cost (`GatewayCost`, `baton plan --gateway-*`) from
  its loop CPU, and the score a grid search over simulated costs minimises.
- `step_fit`: a worker's profile, decode table and step noise from tapped engine steps (the policy
  simulator's replays).

The experiment drivers that run clusters and read result files stay in lab/experiments and call these.
Nothing here imports torch; `gateway` and `step_fit` use numpy. The package imports nothing itself, so
the scheduler core, which imports `windowed` (compiled with it: scheduler/native.py), loads no numpy.
"""
