"""Prefect flows: the pipeline's stages composed from tasks/."""

import logging

# moplex_core reports at INFO what the log of a run should show: an artifact or an EM run resumed
# after an interruption, each EM iteration, what a stage wrote. Prefect attaches its console and
# API handlers to that logger (PREFECT_LOGGING_EXTRA_LOGGERS, set by `moplex` and prefect.yaml);
# left at the root logger's WARNING, those lines would be dropped.
logging.getLogger("moplex_core").setLevel(logging.INFO)
