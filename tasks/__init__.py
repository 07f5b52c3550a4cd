"""Prefect tasks: thin doors onto moplex_core (load inputs, call the library, write the artifact)."""
