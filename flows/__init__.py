"""Prefect flows: the pipeline's stages composed from tasks/."""
