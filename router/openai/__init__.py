"""The OpenAI-compatible HTTP front of the router (see app.py)."""
