"""The planner: a model of one engine step calibrated on the runtime itself (model.py, calibrate.py), and a search
over deployment plans for a workload (`python -m launch.plan`, __main__.py)."""
