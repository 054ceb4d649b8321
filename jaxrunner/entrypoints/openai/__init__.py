"""OpenAI-compatible HTTP server: ``jaxrunner serve``."""
