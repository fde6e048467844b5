"""Hyperparameter tuning with Optuna: pruned search, parallel worker processes, shared (distributed) studies."""

# here rather than in storage.py so that building the CLI parser does not import Optuna
SAMPLERS = ("tpe", "random", "cmaes")
PRUNERS = ("median", "halving", "none")
