"""Runs of clients nobody here wrote (schemathesis, guidellm, lm-evaluation-harness, the openai SDK) against the server."""
