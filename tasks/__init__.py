"""Prefect tasks: thin doors onto moplex_core (load inputs, call the library, write the artifact)."""

import logging

# moplex_core reports at INFO what the log of a run should show: an artifact or an EM run resumed
# after an interruption, each EM iteration, what a stage wrote, a wait for another writer's lock.
# Prefect attaches its console and API handlers to that logger (PREFECT_LOGGING_EXTRA_LOGGERS, set
# by `moplex` and prefect.yaml); left at the root logger's WARNING, those lines would be dropped.
# Set here, not in flows/: a worker loads a deployment's flow file as a script of its own, so
# flows/__init__.py never runs there, while every flow imports tasks.
logging.getLogger("moplex_core").setLevel(logging.INFO)
