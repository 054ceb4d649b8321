"""Front ends other than the Python API: the OpenAI-compatible HTTP server."""
