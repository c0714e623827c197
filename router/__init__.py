"""The router: admits, routes and streams requests between prefill and decode pools (no torch)."""
