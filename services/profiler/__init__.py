"""`baton profile`: measure one (model, hardware) pair and write the scheduler's `WorkerProfile`.

grid.py picks the step shapes, measure.py times them on the serving engine's own model runner,
fit.py fits the cost model's coefficients, main.py is the command. The scheduler reads the output
with `--profile` (scheduler/adapters/profiles.py).
"""
